//! `kiln plan`: what a job needs per rank and what it costs, before it starts.

use crate::train::FinetuneArgs;
use anyhow::{Result, bail};
use kiln_plan::{Cost, Layout, Plan, Profile};
use kiln_train::Recipe;

/// Arguments of `kiln plan`: every option of `kiln train` and `kiln finetune`, and the
/// hardware.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Ranks (GPUs) of the job: parallel.ranks (default: the recipe's).
    #[arg(long)]
    gpus: Option<usize>,
    /// The hardware profile: h100, h100-pcie, h200, a100-40gb, a100-80gb, l40s, or cpu (this
    /// machine, calibrated by micro-benchmarks; the default).
    #[arg(long, default_value = "cpu")]
    gpu: String,
    /// Ranks per node (default: the profile's, 8 for GPUs; all ranks for cpu).
    #[arg(long)]
    per_node: Option<usize>,
    /// A Hugging Face model directory or its config.json (model.from; weights are not read).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Tokens to train on: the wall time, GPU-hours and price of the run.
    #[arg(long)]
    tokens: Option<f64>,
    /// Price per GPU-hour (with --tokens).
    #[arg(long)]
    price: Option<f64>,
    /// Rank the layouts that fit (strategy x tp x pp x micro-batches x remat) by cost.
    #[arg(long)]
    search: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
    /// Measure this machine again (--gpu cpu) instead of reading the calibration kept from
    /// an earlier plan, and keep the new one.
    #[arg(long)]
    recalibrate: bool,
    #[command(flatten)]
    job: FinetuneArgs,
}

/// The plan of `recipe` on `profile`.
pub fn plan_recipe(recipe: &Recipe, profile: &Profile) -> Result<Plan> {
    // Ranks on one machine's CPU run over kiln's local group; GPUs over NCCL.
    let backend = match profile.sharing > 1 || profile.name == "cpu" {
        true => "local",
        false => "nccl",
    };
    let sim = kiln_plan::simulate(recipe, profile.per_node, backend)?;
    let p = &recipe.parallel;
    let layout = Layout {
        batch_size: recipe.train.batch_size,
        seq_len: recipe.train.seq_len,
        pp: p.pp.max(1),
        microbatches: p.microbatches.max(1),
        schedule: p.schedule,
        half: recipe.train.precision.is_mixed(),
    };
    kiln_plan::estimate(&sim, &layout, profile).map_err(anyhow::Error::msg)
}

fn world(recipe: &Recipe) -> usize {
    match recipe.parallel.world_size {
        0 => recipe.parallel.ranks,
        w => w,
    }
}

/// The recipe of the job these arguments describe.
fn recipe(args: &PlanArgs) -> Result<Recipe> {
    let mut job = args.job.clone();
    let mut extra = Vec::new();
    if let Some(n) = args.gpus {
        extra.push(format!("parallel.ranks={n}"));
    }
    if let Some(m) = &args.model {
        let dir = match m.file_name().is_some_and(|f| f == "config.json") {
            true => m
                .parent()
                .map(std::path::Path::to_path_buf)
                .unwrap_or_default(),
            false => m.clone(),
        };
        if !dir.join("config.json").is_file() {
            bail!("--model {}: no config.json there", m.display());
        }
        extra.push(format!("model.from=\"{}\"", dir.display()));
    }
    job.add_overrides(&extra);
    let mut recipe = crate::train::job_recipe(&job)?;
    recipe.parallel.world_size = 0;
    recipe.parallel.ranks = world(&recipe).max(1);
    Ok(recipe)
}

pub fn plan(args: &PlanArgs) -> Result<()> {
    if args.price.is_some() && args.tokens.is_none() {
        bail!("--price prices a token budget: give --tokens too");
    }
    let recipe = recipe(args)?;
    let world = recipe.parallel.ranks;
    if args.recalibrate {
        kiln_plan::calibrate::recalibrate();
    }
    let mut profile = kiln_plan::profile(&args.gpu, world).map_err(anyhow::Error::msg)?;
    if let Some(n) = args.per_node {
        if n == 0 {
            bail!("--per-node must be at least 1");
        }
        profile.per_node = n;
    }
    // (After calibrating: the micro-benchmarks run as kiln train does.)
    if args.search {
        return search(&recipe, &profile, args);
    }
    let plan = plan_recipe(&recipe, &profile)?;
    let cost = args.tokens.map(|t| kiln_plan::cost(&plan, t, args.price));
    if args.json {
        let out = serde_json::json!({
            "job": describe(&recipe),
            "profile": profile,
            "plan": plan,
            "cost": cost,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    for line in report(&recipe, &profile, &plan, cost.as_ref()) {
        println!("{line}");
    }
    Ok(())
}

/// `kiln train --plan-only` / `kiln finetune --plan-only`: the plan of the run on this
/// machine's CPU.
pub fn plan_only(recipe: &Recipe) -> Result<()> {
    let mut recipe = recipe.clone();
    recipe.parallel.ranks = world(&recipe).max(1);
    recipe.parallel.world_size = 0;
    let profile = kiln_plan::profile("cpu", recipe.parallel.ranks).map_err(anyhow::Error::msg)?;
    let plan = plan_recipe(&recipe, &profile)?;
    for line in report(&recipe, &profile, &plan, None) {
        println!("{line}");
    }
    Ok(())
}

/// A job in one line.
pub fn describe(recipe: &Recipe) -> String {
    let p = &recipe.parallel;
    let t = &recipe.train;
    let mut s = format!("{} over {} ranks", p.strategy, world(recipe));
    if p.tp > 1 {
        s += &format!(", tp {}", p.tp);
        if p.sequence_parallel {
            s += " (sequence parallel)";
        }
    }
    if p.pp > 1 {
        s += &format!(
            ", pp {} ({}, {} micro-batches)",
            p.pp, p.schedule, p.microbatches
        );
    }
    s += &format!(", {}, remat {}", t.precision.name(), t.remat);
    if let Some(l) = &recipe.lora {
        s += &format!(", LoRA r {}{}", l.r, if l.qlora { " (QLoRA)" } else { "" });
    }
    s += &format!(", batch {} x seq {}", t.batch_size, t.seq_len);
    s
}

fn gib(b: f64) -> String {
    match b {
        b if b >= (1u64 << 30) as f64 => format!("{:.2} GiB", b / (1u64 << 30) as f64),
        b => format!("{:.1} MiB", b / (1u64 << 20) as f64),
    }
}

/// The plan as the lines `kiln plan` prints.
pub fn report(recipe: &Recipe, profile: &Profile, plan: &Plan, cost: Option<&Cost>) -> Vec<String> {
    let mut out = vec![
        format!("kiln plan: {}", describe(recipe)),
        format!(
            "on {} ({}), {} ranks per node",
            profile.name, profile.description, profile.per_node
        ),
        format!(
            "simulated {} rank(s), one per role, in {:.2} s",
            plan.roles.len(),
            plan.simulated_in_s
        ),
        String::new(),
    ];
    let fits = match plan.fits {
        true => "fits",
        false => "DOES NOT FIT",
    };
    let limit = match profile.sharing > 1 {
        true => format!("{} for all ranks together", gib(profile.memory)),
        false => format!("{} per rank", gib(profile.memory)),
    };
    out.push(format!(
        "memory per rank: peak {} ({fits}: {limit})",
        gib(plan.peak)
    ));
    out.push(format!(
        "  {:<6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "stage",
        "peak",
        "held",
        "params",
        "grads",
        "optimizer",
        "activations",
        "backward",
        "gathered",
        "comm"
    ));
    for r in &plan.roles {
        let m = &r.memory;
        out.push(format!(
            "  {:<6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
            r.stage,
            gib(m.peak),
            gib(m.held_before),
            gib(m.params),
            gib(m.grads),
            gib(m.optimizer),
            gib(m.activations),
            gib(m.backward),
            gib(m.gathered),
            gib(m.comm)
        ));
    }
    out.push(String::new());
    out.push(format!("step: {:.4} s", plan.step_s));
    for r in &plan.roles {
        let [f, b, o] = r.compute_s;
        out.push(format!(
            "  stage {}: compute forward {:.4} s, backward {:.4} s, rest {:.4} s; collectives \
             waited {:.4} s, overlapped {:.4} s ({:.4} s exposed); {:.2} TFLOP, {} ops",
            r.stage,
            f,
            b,
            o,
            r.comm_blocking_s,
            r.comm_overlapped_s,
            r.comm_exposed_s,
            r.work.flops() / 1e12,
            r.work.ops
        ));
    }
    if let Some(b) = plan.bubble {
        out.push(format!("  pipeline bubble {:.1}%", 100.0 * b));
    }
    out.push(format!(
        "throughput: {:.0} tokens/s per rank ({:.0} for the job); FLOP utilisation {:.1}%",
        plan.tokens_per_s_per_gpu,
        plan.tokens_per_s_per_gpu * plan.world as f64,
        100.0 * plan.flop_utilisation
    ));
    out.push(format!("efficiency factor {}", profile.efficiency_source));
    if let Some(c) = cost {
        let price = c
            .price
            .map(|p| format!(", {p:.2} at the price given"))
            .unwrap_or_default();
        out.push(format!(
            "budget: {:.3e} tokens = {:.0} steps = {:.2} h wall, {:.1} GPU-hours{price}",
            c.tokens, c.steps, c.hours, c.gpu_hours
        ));
    }
    out
}

/// `--search`: every layout of the job's ranks that kiln can run, planned, the ones that fit
/// ranked by cost.
fn search(base: &Recipe, profile: &Profile, args: &PlanArgs) -> Result<()> {
    let world = base.parallel.ranks;
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut rows: Vec<(Recipe, Plan)> = Vec::new();
    let mut refused = 0usize;
    let started = std::time::Instant::now();
    for pp in divisors(world).filter(|&p| p <= 16) {
        for tp in divisors(world / pp).filter(|&t| t <= profile.per_node.min(8)) {
            let dp = world / pp / tp;
            let strategies: Vec<String> = match dp {
                1 => vec!["ddp".into()],
                _ => vec!["ddp".into(), "zero1".into(), "zero2".into(), "zero3".into()],
            };
            let microbatches: Vec<usize> = match pp {
                1 => vec![1],
                p => vec![p, 2 * p, 4 * p],
            };
            for strategy in &strategies {
                for &m in &microbatches {
                    for remat in ["off", "balanced"] {
                        let mut r = base.clone();
                        let text = format!(
                            "parallel.pp={pp}\nparallel.tp={tp}\nparallel.strategy=\"{strategy}\"\n\
                             parallel.microbatches={m}\ntrain.remat=\"{remat}\""
                        );
                        let o: Vec<String> = text.lines().map(str::to_string).collect();
                        r = match Recipe::parse(&r.to_toml(), "search", &o) {
                            Ok(r) => r,
                            Err(_) => {
                                refused += 1;
                                continue;
                            }
                        };
                        match plan_recipe(&r, profile) {
                            Ok(p) => rows.push((r, p)),
                            Err(_) => refused += 1,
                        }
                    }
                }
            }
        }
    }
    let fit: Vec<&(Recipe, Plan)> = {
        let mut f: Vec<&(Recipe, Plan)> = rows.iter().filter(|(_, p)| p.fits).collect();
        f.sort_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s));
        f
    };
    if args.json {
        let out: Vec<serde_json::Value> = fit
            .iter()
            .map(|(r, p)| {
                serde_json::json!({
                    "layout": describe(r),
                    "plan": p,
                    "cost": args.tokens.map(|t| kiln_plan::cost(p, t, args.price)),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "kiln plan --search: {} layouts of {world} ranks planned in {:.1} s on {} ({} do not fit, \
         {refused} refused by the recipe's checks)",
        rows.len(),
        started.elapsed().as_secs_f64(),
        profile.name,
        rows.len() - fit.len()
    );
    println!(
        "  {:<4} {:<72} {:>10} {:>10} {:>12} {:>12}",
        "#", "layout", "peak", "step s", "tokens/s/gpu", "GPU-hours"
    );
    for (i, (r, p)) in fit.iter().take(15).enumerate() {
        let hours = args
            .tokens
            .map(|t| format!("{:.1}", kiln_plan::cost(p, t, args.price).gpu_hours))
            .unwrap_or_else(|| "-".into());
        println!(
            "  {:<4} {:<72} {:>10} {:>10.4} {:>12.0} {:>12}",
            i + 1,
            describe(r),
            gib(p.peak),
            p.step_s,
            p.tokens_per_s_per_gpu,
            hours
        );
    }
    if fit.is_empty() {
        bail!("no layout of {world} ranks fits {}", profile.name);
    }
    Ok(())
}
