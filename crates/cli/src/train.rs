//! `kiln train` and `kiln export`: the training job (see `kiln-train`) from the command line.

use crate::progress::Console;
use anyhow::{Context, Result, bail};
use kiln_comm::{DeviceSharing, GroupOptions, ProcessGroup};
use kiln_train::{Recipe, RunOptions, train_rank_with};
use std::path::PathBuf;
use std::sync::Arc;

/// Arguments of `kiln train`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// The recipe (TOML); the built-in default when omitted (`--print-recipe` shows it).
    #[arg(long)]
    recipe: Option<PathBuf>,
    /// Override any recipe key: `--set train.lr=1e-3` (repeatable; applied last).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// train.steps
    #[arg(long)]
    steps: Option<usize>,
    /// parallel.ranks: ranks as threads of this process (ignored under a launcher).
    #[arg(long)]
    ranks: Option<usize>,
    /// parallel.strategy: ddp, zero1, zero2, zero3 (fsdp), hybrid:S.
    #[arg(long)]
    strategy: Option<String>,
    /// parallel.pp: pipeline stages; the ranks are pp stages x data-parallel ranks, the
    /// strategy applying to each stage's data-parallel ranks.
    #[arg(long)]
    pp: Option<usize>,
    /// parallel.tp: tensor-parallel ranks (Megatron's column/row split of each block's
    /// layers; the ranks are pp stages x data-parallel ranks x tp).
    #[arg(long)]
    tp: Option<usize>,
    /// parallel.tp_plan: which layers tensor parallelism splits how, as pattern=style items
    /// (c_attn=colwise/3,c_fc=colwise,c_proj=rowwise); default: the model's own.
    #[arg(long)]
    tp_plan: Option<String>,
    /// parallel.sequence_parallel: with --tp, Megatron's sequence parallelism (norm and
    /// residual activations split along the tokens over the tp ranks).
    #[arg(long)]
    sequence_parallel: bool,
    /// parallel.microbatches: micro-batches per step of a pipeline.
    #[arg(long)]
    microbatches: Option<usize>,
    /// parallel.schedule: the pipeline's schedule: gpipe, 1f1b or interleaved:V.
    #[arg(long)]
    schedule: Option<String>,
    /// parallel.split: the units where the pipeline's chunks after the first start
    /// (e.g. h.2,h.5), or `measured` (chunks balanced by each unit's forward and backward time, measured at
    /// start); default: chunks balanced by parameter count.
    #[arg(long)]
    pp_split: Option<String>,
    /// train.remat: off; balanced (memory-bound ops recomputed in backward); budget=SIZE
    /// (activations held to SIZE per rank, e.g. budget=64MiB; the rest recomputed).
    #[arg(long)]
    remat: Option<String>,
    /// train.precision: f32; bf16 or f16 (matmuls and ZeRO-3 parameter gathers in that dtype,
    /// f32 parameters and optimizer state; f16 with dynamic loss scaling).
    #[arg(long)]
    precision: Option<String>,
    /// data.source: "synthetic" or a UTF-8 text file.
    #[arg(long)]
    data: Option<String>,
    /// output.dir: metrics, recipe and snapshots.
    #[arg(long)]
    out: Option<PathBuf>,
    /// train.seed
    #[arg(long)]
    seed: Option<u64>,
    /// train.batch_size (sequences per step over all ranks).
    #[arg(long)]
    batch_size: Option<usize>,
    /// train.lr (peak learning rate).
    #[arg(long)]
    lr: Option<f64>,
    /// output.snapshot_every
    #[arg(long)]
    snapshot_every: Option<usize>,
    /// output.memory_snapshot_every: also a snapshot in this machine's memory every this many
    /// steps, so a restart recomputes at most that many.
    #[arg(long)]
    memory_snapshot_every: Option<usize>,
    /// Continue from the newest snapshot in the output directory (any world size or strategy).
    #[arg(long)]
    resume: bool,
    /// Stop after this step, with a snapshot (the schedule stays that of train.steps): for jobs
    /// that must fit a time slot; the next one passes --resume.
    #[arg(long)]
    stop_after: Option<usize>,
    /// Start afresh even if the output directory holds snapshots (deletes them).
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Inner backend: cpu (Flex), or cuda (needs --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Print the default recipe (TOML, commented) and exit.
    #[arg(long)]
    print_recipe: bool,
    /// Print what the run would need and take (`kiln plan` on this machine's CPU) and exit.
    #[arg(long)]
    plan_only: bool,
}

impl TrainArgs {
    fn overrides(&self) -> Vec<String> {
        let mut o = Vec::new();
        let mut put = |key: &str, value: Option<String>| {
            if let Some(v) = value {
                o.push(format!("{key}={v}"));
            }
        };
        put("train.steps", self.steps.map(|v| v.to_string()));
        put("parallel.ranks", self.ranks.map(|v| v.to_string()));
        put("parallel.strategy", self.strategy.clone().map(quote));
        put("parallel.pp", self.pp.map(|v| v.to_string()));
        put("parallel.tp", self.tp.map(|v| v.to_string()));
        put("parallel.tp_plan", self.tp_plan.clone().map(quote));
        put(
            "parallel.sequence_parallel",
            self.sequence_parallel.then(|| "true".to_string()),
        );
        put(
            "parallel.microbatches",
            self.microbatches.map(|v| v.to_string()),
        );
        put("parallel.schedule", self.schedule.clone().map(quote));
        put("parallel.split", self.pp_split.clone().map(quote));
        put("train.remat", self.remat.clone().map(quote));
        put("train.precision", self.precision.clone().map(quote));
        put("data.source", self.data.clone().map(quote));
        put(
            "output.dir",
            self.out.as_ref().map(|p| quote(p.display().to_string())),
        );
        put("train.seed", self.seed.map(|v| v.to_string()));
        put("train.batch_size", self.batch_size.map(|v| v.to_string()));
        put("train.lr", self.lr.map(|v| format!("{v:?}")));
        put(
            "output.snapshot_every",
            self.snapshot_every.map(|v| v.to_string()),
        );
        put(
            "output.memory_snapshot_every",
            self.memory_snapshot_every.map(|v| v.to_string()),
        );
        o.extend(self.set.iter().cloned());
        o
    }
}

/// A TOML basic string.
fn quote(s: String) -> String {
    format!("{:?}", s)
}

/// Where a rank sits on its node, for choosing its GPU (`kiln_comm::cuda_ordinal`).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Slot {
    local_rank: usize,
    local_world_size: usize,
    sharing: DeviceSharing,
}

fn rank_on_device(
    recipe: &Recipe,
    group: Arc<dyn ProcessGroup>,
    launched: bool,
    options: RunOptions,
    device: &str,
    slot: Slot,
) -> kiln_train::Result<kiln_train::Summary> {
    // Rank 0 prints the run's progress and summary; the other ranks' consoles stay unused.
    let console = &mut Console::new();
    let result = match device {
        "cpu" => train_rank_with::<burn::backend::Flex>(
            recipe,
            group,
            launched,
            options,
            &Default::default(),
            console,
        ),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let ordinal = kiln_comm::choose_cuda_device(
                slot.local_rank,
                slot.local_world_size,
                slot.sharing,
            )?;
            let device = burn::backend::cuda::CudaDevice::new(ordinal);
            train_rank_with::<kiln::Cuda>(recipe, group, launched, options, &device, console)
        }
        other => {
            let _ = slot;
            Err(kiln_train::TrainError::Recipe(format!(
                "device '{other}' is not built in (cpu; cuda needs `--features cuda`)"
            )))
        }
    };
    // Snapshots are written asynchronously: the last one is complete before the rank ends.
    let flushed = kiln_train::snapshot::flush();
    let summary = result?;
    flushed?;
    Ok(summary)
}

pub fn train(args: &TrainArgs) -> Result<()> {
    if args.print_recipe {
        println!("{}", kiln_train::DEFAULT_TOML.trim_end());
        return Ok(());
    }
    let recipe = Recipe::load(args.recipe.as_deref(), &args.overrides())?;
    if recipe.lora.is_some() {
        bail!("the recipe has a [lora] section: fine-tune with `kiln finetune`");
    }
    run(&recipe, args)
}

/// Arguments of `kiln finetune`.
#[derive(Debug, Clone, clap::Args)]
pub struct FinetuneArgs {
    /// The pretrained base: a Hugging Face directory (model.from).
    #[arg(long)]
    base: Option<PathBuf>,
    /// lora.r: the adapters' rank (default 8).
    #[arg(long)]
    lora_r: Option<usize>,
    /// lora.alpha: updates scaled by alpha / r (default 2 r).
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// lora.dropout: dropout on the adapters' input while training, PEFT's lora_dropout
    /// (default 0).
    #[arg(long)]
    lora_dropout: Option<f64>,
    /// lora.targets, comma-separated: module names (q_proj, PEFT's rule), globs
    /// (*.attn.c_attn) or all-linear. Default: the attention projections (Llama: q_proj,
    /// k_proj, v_proj, o_proj; GPT-2: c_attn, attn.c_proj).
    #[arg(long, value_delimiter = ',')]
    targets: Vec<String>,
    /// lora.adapter: start from this PEFT adapter directory (its r, alpha and targets).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// lora.merge_into: after training, write the base with the adapters merged in here.
    #[arg(long)]
    merge_into: Option<PathBuf>,
    /// lora.qlora: QLoRA, the base's linear weights stored 4-bit (NF4 with double
    /// quantisation) and dequantised on use.
    #[arg(long)]
    qlora: bool,
    #[command(flatten)]
    train: TrainArgs,
}

/// The attention projections of a base, by its `model_type`.
pub fn finetune(args: &FinetuneArgs) -> Result<()> {
    let t = &args.train;
    if t.print_recipe {
        println!("{}", kiln_train::DEFAULT_TOML.trim_end());
        println!(
            "\n[lora]\nr = 8\nalpha = 16.0\ntargets = [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"]"
        );
        return Ok(());
    }
    run(&finetune_recipe(args)?, t)
}

/// The recipe `kiln finetune` runs with these arguments.
pub fn finetune_recipe(args: &FinetuneArgs) -> Result<Recipe> {
    let t = &args.train;
    // What the recipe file already says about LoRA: flags and defaults fill in the rest.
    // Read once: what the recipe file already says about LoRA, and the recipe itself below.
    let (text, origin) = Recipe::read(t.recipe.as_deref())?;
    let file: toml::Table = match &t.recipe {
        Some(_) => toml::from_str(&text).with_context(|| format!("{origin} is not valid TOML"))?,
        None => toml::Table::new(),
    };
    let in_file = |key: &str| {
        file.get("lora")
            .and_then(|l| l.as_table())
            .is_some_and(|l| l.contains_key(key))
    };
    let from = args.base.clone().or_else(|| {
        file.get("model")
            .and_then(|m| m.get("from"))
            .and_then(|f| f.as_str())
            .map(PathBuf::from)
    });
    let Some(from) = from else {
        bail!("kiln finetune needs a pretrained base: --base DIR (a Hugging Face directory)");
    };
    let mut o = vec![format!("model.from={}", quote(from.display().to_string()))];
    let r = args.lora_r.unwrap_or(8);
    if args.lora_r.is_some() || !in_file("r") {
        o.push(format!("lora.r={r}"));
    }
    if args.lora_alpha.is_some() || !in_file("alpha") {
        o.push(format!(
            "lora.alpha={:?}",
            args.lora_alpha.unwrap_or(2.0 * r as f64)
        ));
    }
    if !args.targets.is_empty() || !in_file("targets") {
        let targets: Vec<String> = if args.targets.is_empty() {
            kiln_zoo::ModelType::of_dir(&from)?
                .default_lora_targets()
                .iter()
                .map(|s| s.to_string())
                .collect()
        } else {
            args.targets.clone()
        };
        let list: Vec<String> = targets.into_iter().map(quote).collect();
        o.push(format!("lora.targets=[{}]", list.join(", ")));
    }
    if let Some(p) = args.lora_dropout {
        o.push(format!("lora.dropout={p:?}"));
    }
    if let Some(dir) = &args.adapter {
        o.push(format!("lora.adapter={}", quote(dir.display().to_string())));
    }
    if let Some(dir) = &args.merge_into {
        o.push(format!(
            "lora.merge_into={}",
            quote(dir.display().to_string())
        ));
    }
    if args.qlora {
        o.push("lora.qlora=true".into());
    }
    o.extend(t.overrides());
    Ok(Recipe::parse(&text, &origin, &o)?)
}

/// `KILN_RESTART_COUNT`: which restart of the job `kiln launch --max-restarts` started (0:
/// the first start).
fn restart_count() -> Result<usize> {
    match std::env::var("KILN_RESTART_COUNT") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().with_context(|| {
            format!("KILN_RESTART_COUNT={v:?} is not a count (kiln launch sets it)")
        }),
        _ => Ok(0),
    }
}

/// The options of this start of the run: a restart by `kiln launch` continues from the latest
/// complete snapshot, or starts afresh when the job failed before writing one (the snapshots
/// are then never deleted: `--overwrite` applied to the first start only).
fn run_options(args: &TrainArgs, restart: usize) -> RunOptions {
    if restart == 0 {
        return RunOptions {
            resume: args.resume,
            overwrite: args.overwrite,
            stop_after: args.stop_after,
            restart: false,
            steps_only: false,
        };
    }
    // A restart continues from the newest snapshot (made from the machines' memory snapshots
    // first, with ranks on several), else starts afresh: `kiln_train` decides once the ranks
    // meet, the same on every rank.
    RunOptions {
        resume: false,
        overwrite: false,
        stop_after: args.stop_after,
        restart: true,
        steps_only: false,
    }
}

fn run(recipe: &Recipe, args: &TrainArgs) -> Result<()> {
    // Training goes on while snapshots are written (KILN_SYNC_SNAPSHOTS=1: it waits, as the
    // library does by default); each rank flushes before it ends (`rank_on_device`).
    kiln_train::snapshot::set_asynchronous(
        std::env::var("KILN_SYNC_SNAPSHOTS").map_or(true, |v| v.trim() != "1"),
    );
    let launched = kiln_comm::LaunchEnv::launched();
    let restart = if launched { restart_count()? } else { 0 };
    let options = run_options(args, restart);
    if launched {
        let env = kiln_comm::LaunchEnv::from_env()?;
        let group = kiln_comm::join(
            recipe.parallel.backend.name(),
            &env,
            GroupOptions::default(),
        )
        .with_context(|| format!("parallel.backend = \"{}\"", recipe.parallel.backend.name()))?;
        let slot = Slot {
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            sharing: DeviceSharing::for_backend(group.backend()),
        };
        // This process's compute on a pool the rank runs in (its kernels then start inside
        // the pool, not from outside it), of the threads `kiln launch` gave it.
        let threads = kiln::shard::threads::per_rank(1).map_err(anyhow::Error::msg)?;
        kiln::shard::threads::with_own_pool(threads, || {
            rank_on_device(recipe, group, true, options, &args.device, slot)
        })?;
        return Ok(());
    }
    let ranks = recipe.parallel.ranks;
    if ranks == 0 {
        bail!("parallel.ranks must be at least 1");
    }
    recipe.check_world(ranks, false)?;
    let results = kiln::shard::threads::spawn_ranks(ranks, |g: kiln_comm::LocalGroup| {
        // Threads exchange through host memory: on fewer GPUs than ranks they share.
        let slot = Slot {
            local_rank: g.rank(),
            local_world_size: ranks,
            sharing: DeviceSharing::RoundRobin,
        };
        rank_on_device(recipe, Arc::new(g), false, options, &args.device, slot)
    })
    .map_err(anyhow::Error::msg)?;
    kiln_train::rank_zero_or_root_cause(results)?;
    Ok(())
}

/// Arguments of `kiln export`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// A snapshot directory, or a run directory (its newest snapshot).
    snapshot: PathBuf,
    /// The Hugging Face directory to write (`config.json`, `model.safetensors`).
    #[arg(long)]
    out: PathBuf,
    /// The weights' dtype: f32 (the snapshot's masters), bf16 or f16 (rounded to nearest).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16", "f16"])]
    dtype: String,
}

pub fn export(args: &ExportArgs) -> Result<()> {
    let dtype = match args.dtype.as_str() {
        "bf16" => burn::tensor::FloatDType::BF16,
        "f16" => burn::tensor::FloatDType::F16,
        _ => burn::tensor::FloatDType::F32,
    };
    let weights = kiln_train::export_as(&args.snapshot, &args.out, dtype)?;
    println!("wrote {}", weights.display());
    Ok(())
}

/// The recipe of the job `kiln train` (or, with a base or LoRA options, `kiln finetune`) would
/// run with these arguments: what `kiln plan` plans.
pub fn job_recipe(args: &FinetuneArgs) -> Result<Recipe> {
    let t = &args.train;
    let lora_flags = args.base.is_some()
        || args.lora_r.is_some()
        || args.lora_alpha.is_some()
        || args.qlora
        || !args.targets.is_empty()
        || args.adapter.is_some();
    let recipe = Recipe::load(t.recipe.as_deref(), &t.overrides());
    match (lora_flags, recipe) {
        (false, Ok(r)) if r.lora.is_none() => Ok(r),
        (false, Err(e)) => Err(e.into()),
        _ => finetune_recipe(args),
    }
}

impl TrainArgs {
    /// `--plan-only`.
    pub fn plan_only(&self) -> bool {
        self.plan_only
    }

    /// The recipe `kiln train` runs with these arguments.
    pub fn recipe(&self) -> Result<Recipe> {
        Ok(Recipe::load(self.recipe.as_deref(), &self.overrides())?)
    }
}

impl FinetuneArgs {
    /// `--plan-only`.
    pub fn plan_only(&self) -> bool {
        self.train.plan_only
    }

    /// Adds `--set` overrides (applied last).
    pub fn add_overrides(&mut self, o: &[String]) {
        self.train.set.extend(o.iter().cloned());
    }
}
