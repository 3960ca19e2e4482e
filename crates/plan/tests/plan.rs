//! `kiln plan` against real runs: the simulated step on shapes holds the model state a real
//! run holds, byte for byte, and a peak close to the real one; the model state follows ZeRO's
//! formulas; the time model, profiles and errors.

use burn::backend::Flex;
use kiln_plan::{Layout, estimate, profile, simulate};
use kiln_train::{Recipe, RunOptions, train_threads};

#[global_allocator]
static ALLOC: kiln_shard::account::RankAlloc = kiln_shard::account::RankAlloc;

fn recipe(extra: &[&str]) -> Recipe {
    let mut o: Vec<String> = [
        "model.dim=64",
        "model.layers=2",
        "model.heads=4",
        "model.context=128",
        "train.seq_len=128",
        "train.batch_size=8",
        "train.steps=3",
        "train.eval_every=0",
        "train.sample_chars=0",
        "output.snapshot_every=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    o.extend(extra.iter().map(|s| s.to_string()));
    Recipe::load(None, &o).unwrap()
}

/// The worst rank's memory of a real run of `r` on Flex, ranks as threads.
fn real(r: &Recipe, out: &str) -> kiln_train::RankMemory {
    let mut r = r.clone();
    r.output.dir =
        std::env::temp_dir().join(format!("kiln-plan-test-{out}-{}", std::process::id()));
    let options = RunOptions {
        overwrite: true,
        ..RunOptions::default()
    };
    let s = train_threads::<Flex>(&r, r.parallel.ranks, options).unwrap();
    let _ = std::fs::remove_dir_all(&r.output.dir);
    *s.memory.iter().max_by_key(|m| m.step.peak).unwrap()
}

#[test]
fn shapes_hold_the_model_state_a_real_run_holds() {
    for (name, extra) in [
        ("ddp", vec!["parallel.ranks=2", "parallel.strategy=\"ddp\""]),
        (
            "zero3",
            vec!["parallel.ranks=2", "parallel.strategy=\"zero3\""],
        ),
        ("tp", vec!["parallel.ranks=2", "parallel.tp=2"]),
    ] {
        let r = recipe(&extra);
        let real = real(&r, name);
        let sim = simulate(&r, 8, "local").unwrap();
        let plan = sim.roles[0].memory;
        // Parameters, gradients and optimizer state: the same tensors, the same bytes.
        assert_eq!(plan.step.params, real.step.params, "{name}: params");
        assert_eq!(plan.step.grads, real.step.grads, "{name}: grads");
        assert_eq!(plan.optimizer, real.optimizer, "{name}: optimizer");
        // The peak: the step's tensors counted as the real run counts them (a real run also
        // holds Flex's own scratch, a few hundred KiB at this size).
        let err = plan.step.peak as f64 / real.step.peak as f64 - 1.0;
        println!(
            "{name}: peak plan {} real {} ({:+.1}%)",
            plan.step.peak,
            real.step.peak,
            100.0 * err
        );
        assert!(err.abs() < 0.10, "{name}: peak off by {:.1}%", 100.0 * err);
    }
}

#[test]
fn model_state_follows_zero_formulas() {
    // fp32 AdamW (Rajbhandari et al. 2020): parameters 4 Psi (ZeRO-3: 4 Psi / N), optimizer
    // state 8 Psi (ZeRO-1/2/3: 8 Psi / N); the gradients the optimizer receives 4 Psi (DDP),
    // 4 Psi / N where they are reduce-scattered (ZeRO-2/3).
    let n = 4.0;
    let one = simulate(&recipe(&["parallel.ranks=1"]), 8, "local").unwrap();
    let psi = one.roles[0].memory.step.params as f64 / 4.0;
    for (strategy, params, grads, optimizer) in [
        ("ddp", 4.0 * psi, Some(4.0 * psi), 8.0 * psi),
        ("zero1", 4.0 * psi, None, 8.0 * psi / n),
        ("zero2", 4.0 * psi, Some(4.0 * psi / n), 8.0 * psi / n),
        ("zero3", 4.0 * psi / n, Some(4.0 * psi / n), 8.0 * psi / n),
    ] {
        let s = format!("parallel.strategy=\"{strategy}\"");
        let sim = simulate(&recipe(&["parallel.ranks=4", &s]), 8, "local").unwrap();
        let m = sim.roles[0].memory;
        // Shards differ by at most one element per tensor; the optimizer's bytes are its
        // serialisation (a few dozen bytes per tensor on top).
        let near = |got: usize, want: f64| (got as f64 / want - 1.0).abs() < 0.01;
        assert!(
            near(m.step.params, params),
            "{strategy}: params {} vs {params}",
            m.step.params
        );
        if let Some(g) = grads {
            assert!(
                near(m.step.grads, g),
                "{strategy}: grads {} vs {g}",
                m.step.grads
            );
        }
        assert!(
            near(m.optimizer, optimizer),
            "{strategy}: optimizer {} vs {optimizer}",
            m.optimizer
        );
    }
}

#[test]
fn one_rank_per_role_and_the_time_model() {
    // 64 ranks, 4 stages: 4 ranks simulated, one per stage.
    let r = recipe(&[
        "parallel.ranks=64",
        "parallel.pp=4",
        "parallel.microbatches=4",
        "model.layers=4",
        "train.batch_size=64",
        "parallel.strategy=\"zero3\"",
    ]);
    let sim = simulate(&r, 8, "nccl").unwrap();
    assert_eq!(sim.world, 64);
    assert_eq!(sim.roles.len(), 4);
    assert_eq!(
        sim.roles.iter().map(|r| r.rank).collect::<Vec<_>>(),
        vec![0, 16, 32, 48]
    );
    let h100 = profile("h100", 64).unwrap();
    let layout = Layout {
        batch_size: 64,
        seq_len: 128,
        pp: 4,
        microbatches: 4,
        schedule: r.parallel.schedule,
        half: false,
    };
    let plan = estimate(&sim, &layout, &h100).unwrap();
    assert!(plan.fits);
    assert!(plan.step_s > 0.0 && plan.step_s.is_finite());
    // 1F1B over 4 stages and 4 micro-batches: the bubble is about (p-1)/(m+p-1) = 3/7.
    let bubble = plan.bubble.unwrap();
    assert!((bubble - 3.0 / 7.0).abs() < 0.1, "bubble {bubble}");
    // Every stage communicated: ZeRO-3's gathers and reduce-scatters, pipeline sends.
    for role in &plan.roles {
        assert!(role.comm_bytes[1] > 0.0 && role.comm_bytes[2] > 0.0);
        assert!(role.comm_bytes[4] > 0.0);
    }
    // The same job on a slower GPU takes longer; a token budget's cost follows the step.
    let a100 = profile("a100-40gb", 64).unwrap();
    let slower = estimate(&sim, &layout, &a100).unwrap();
    assert!(slower.step_s > plan.step_s);
    let cost = kiln_plan::cost(&plan, 1e9, Some(2.0));
    let steps: f64 = (1e9_f64 / (64.0 * 128.0)).ceil();
    assert_eq!(cost.steps, steps);
    assert!((cost.gpu_hours - steps * plan.step_s / 3600.0 * 64.0).abs() < 1e-9);
    assert!((cost.price.unwrap() - 2.0 * cost.gpu_hours).abs() < 1e-9);
}

#[test]
fn errors_name_what_is_wrong() {
    let e = profile("h800", 8).unwrap_err();
    assert!(e.contains("unknown GPU profile 'h800'") && e.contains("h100") && e.contains("cpu"));
    // A layout that does not divide: the recipe's own check, by name.
    let e = simulate(&recipe(&["parallel.ranks=6", "parallel.pp=4"]), 8, "local").unwrap_err();
    assert!(e.to_string().contains("parallel.pp (4) must divide"), "{e}");
}

#[test]
fn real_groups_refuse_shape_buffers() {
    use kiln_comm::{BufMut, DType, ProcessGroup, ReduceOp};
    let groups = kiln_comm::LocalGroup::new_world(1, kiln_comm::GroupOptions::default());
    let e = groups[0]
        .all_reduce(
            BufMut::Shape {
                dtype: DType::F32,
                len: 1 << 20,
            },
            ReduceOp::Sum,
        )
        .unwrap_err();
    assert!(e.to_string().contains("shape-only buffer"), "{e}");
}
