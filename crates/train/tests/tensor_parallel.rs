//! Tensor parallelism in kiln's training job (ranks as threads): `parallel.tp` trains like one
//! device, alone, beside DDP or ZeRO-1/2/3 (with and without sequence parallelism) and with
//! pipeline stages (also beside ZeRO-1), keeping its split to the last step; a snapshot written at tp 2 x ZeRO-3 dp 2 resumes at tp 1, tp 4 and tp 2 x
//! DDP 2 with the same next-step loss; a tp that does not divide the heads is refused by name.

use common::{chain, recipe, run};

mod common;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * b.abs()
}

#[test]
fn tensor_parallel_runs_train_like_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let heads = ["model.heads=4", "train.batch_size=4"];
    let one = run(
        &recipe(&dir.path().join("one"), "ddp", &heads),
        1,
        false,
        None,
    );
    let two_layers = ["model.heads=4", "train.batch_size=4", "model.layers=2"];
    let two = run(
        &recipe(&dir.path().join("two"), "ddp", &two_layers),
        1,
        false,
        None,
    );
    let zero3 = "parallel.strategy=\"zero3\"";
    let sp = "parallel.sequence_parallel=true";
    for (name, ranks, extra) in [
        ("tp 2", 2, vec!["parallel.tp=2"]),
        ("tp 4", 4, vec!["parallel.tp=4"]),
        ("tp 2 x ddp 2", 4, vec!["parallel.tp=2"]),
        ("tp 2 x zero3 2", 4, vec!["parallel.tp=2", zero3]),
        (
            "tp 2 x zero1 2",
            4,
            vec!["parallel.tp=2", "parallel.strategy=\"zero1\""],
        ),
        (
            "tp 2 x zero2 2",
            4,
            vec!["parallel.tp=2", "parallel.strategy=\"zero2\""],
        ),
        ("tp 2 x zero3 2, sp", 4, vec!["parallel.tp=2", zero3, sp]),
        (
            "tp 2 x pp 2",
            4,
            vec![
                "parallel.tp=2",
                "parallel.pp=2",
                "model.layers=2",
                "parallel.microbatches=2",
            ],
        ),
        (
            "tp 2 x pp 2 x zero1 2",
            8,
            vec![
                "parallel.tp=2",
                "parallel.pp=2",
                "model.layers=2",
                "parallel.microbatches=2",
                "parallel.strategy=\"zero1\"",
            ],
        ),
    ] {
        let mut o = heads.to_vec();
        o.extend(extra.iter());
        let reference = if name.contains("pp") { &two } else { &one };
        let n = run(
            &recipe(&dir.path().join(name), "ddp", &o),
            ranks,
            false,
            None,
        );
        for (step, (a, b)) in n.losses.iter().zip(&reference.losses).enumerate() {
            assert!(close(*a, *b), "{name}, step {}: {a} vs {b}", step + 1);
        }
        let (a, b) = (n.val_loss.unwrap(), reference.val_loss.unwrap());
        assert!(close(a, b), "{name}: validation {a} vs {b}");
        // The last step still splits the layers (the pipeline's gradient reduction and
        // ZeRO's update keep the parts), and no rank holds a gradient or optimizer state
        // larger than its parameters' parts.
        let tp = n.tensor_parallel.as_ref().expect("tp stats");
        // (Sequence parallelism still forms a few tensors whole: ops without a rule yet.)
        assert!(
            tp.all_reduces > 0 && (tp.total_gathers() == 0 || name.ends_with(", sp")),
            "{name}: last step {tp:?}"
        );
        for m in &n.memory {
            let (params, grads) = (m.step.params, m.step.grads);
            assert!(
                grads <= params && m.optimizer <= 2 * params,
                "{name}: rank {}: params {params}, grads {grads}, optimizer {}",
                m.step.rank,
                m.optimizer
            );
        }
    }
}

#[test]
fn a_tensor_parallel_snapshot_resumes_at_other_tp_degrees() {
    let dir = tempfile::tempdir().unwrap();
    let heads = "model.heads=4";
    let whole = run(
        &recipe(&dir.path().join("ref"), "ddp", &[heads]),
        1,
        false,
        None,
    );
    // Written at tp 2 x ZeRO-3 over 2 data-parallel ranks; read at tp 1, at tp 4 and at
    // tp 2 x DDP 2.
    for (tp, ranks) in [
        ("parallel.tp=1", 1),
        ("parallel.tp=4", 4),
        ("parallel.tp=2", 4),
    ] {
        let out = dir.path().join(format!("{tp}-{ranks}"));
        run(
            &recipe(&out, "zero3", &[heads, "parallel.tp=2"]),
            4,
            false,
            Some(3),
        );
        let resumed = run(&recipe(&out, "ddp", &[heads, tp]), ranks, true, None);
        assert!(
            close(resumed.losses[0], whole.losses[3]),
            "{tp} x{ranks}: step 4 {} vs {}",
            resumed.losses[0],
            whole.losses[3]
        );
        let (v, w) = (resumed.val_loss.unwrap(), whole.val_loss.unwrap());
        assert!(close(v, w), "{tp} x{ranks}: validation {v} vs {w}");
    }
}

#[test]
fn a_tp_that_does_not_divide_the_heads_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let r = recipe(dir.path(), "ddp", &["parallel.tp=4"]);
    let e = kiln_train::train_threads::<burn::backend::Flex>(&r, 4, Default::default())
        .map(|_| ())
        .unwrap_err();
    let e = chain(e);
    assert!(e.contains("n_head (2) is not a multiple of tp (4)"), "{e}");
    let r = recipe(dir.path(), "ddp", &["parallel.tp=3"]);
    let e = kiln_train::train_threads::<burn::backend::Flex>(&r, 4, Default::default())
        .map(|_| ())
        .unwrap_err();
    let e = chain(e);
    assert!(
        e.contains("parallel.tp (3) must divide the ranks of a stage (4"),
        "{e}"
    );
}
