//! The recipe: everything a training run needs, from a TOML file plus command-line overrides.
//!
//! Every table denies unknown keys, so a typo (`stpes = 10`) is an error naming the key rather
//! than a silently ignored setting. Overrides are dotted `key=value` pairs applied to the TOML
//! document before it is checked (`train.lr=1e-3`), so they are checked the same way.

use crate::error::{IoContext, Result, TrainError, fail};
use kiln::Remat;
use kiln_pipe::{ScheduleKind, Split};
use kiln_shard::{Precision, Strategy};
use kiln_zoo::{ModelConfig, ModelType, Sizes};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The model.
    #[serde(default)]
    pub model: ModelRecipe,
    /// The text it learns.
    #[serde(default)]
    pub data: DataRecipe,
    /// Optimizer, schedule, batch and steps.
    #[serde(default)]
    pub train: TrainRecipe,
    /// How the work is spread over ranks.
    #[serde(default)]
    pub parallel: ParallelRecipe,
    /// Where progress, metrics and snapshots go.
    #[serde(default)]
    pub output: OutputRecipe,
    /// LoRA fine-tuning (`kiln finetune`): adapters trained on the frozen base of
    /// `model.from`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraRecipe>,
}

/// LoRA adapters on the base model (see `kiln_lora`): only they are trained, snapshotted and
/// written out (PEFT's files in `<output.dir>/adapter`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraRecipe {
    /// The adapters' rank.
    pub r: usize,
    /// Updates are scaled by `alpha / r`.
    pub alpha: f64,
    /// Which weights: module names (`q_proj`, PEFT's rule), globs (`*.attn.c_attn`) or
    /// `all-linear`.
    pub targets: Vec<String>,
    /// Scale by `alpha / sqrt(r)` instead (rsLoRA).
    #[serde(default)]
    pub rslora: bool,
    /// Dropout on the adapters' input while training (PEFT's `lora_dropout`): `base(x) +
    /// s B A drop(x)`. With `adapter`, that directory's `lora_dropout` unless this is set
    /// (non-zero).
    #[serde(default)]
    pub dropout: f64,
    /// QLoRA: the base's linear weights (every `Linear` but `lm_head`, and every target)
    /// stored 4-bit (NF4 with double quantisation) and dequantised on use; the adapters and
    /// the rest of the base stay in f32.
    #[serde(default)]
    pub qlora: bool,
    /// Start from this PEFT adapter directory instead of fresh adapters (its r, alpha and
    /// targets are used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<PathBuf>,
    /// After training, write the base with the adapters merged in to this directory (a
    /// Hugging Face model directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merge_into: Option<PathBuf>,
}

impl Recipe {
    /// The tokenizer `data.tokenizer` names.
    ///
    /// # Errors
    /// A missing or unreadable `tokenizer.json`.
    pub fn tokenizer(&self) -> Result<kiln_hf::Tokenizer> {
        use kiln_hf::Tokenizer;
        Ok(match &self.data.tokenizer {
            TokenizerSource::Bytes => Tokenizer::Bytes,
            TokenizerSource::Auto => match &self.model.from {
                Some(dir) => Tokenizer::of_model_dir(dir)?.unwrap_or(Tokenizer::Bytes),
                None => Tokenizer::Bytes,
            },
            TokenizerSource::File(path) => Tokenizer::from_file(path)?,
        })
    }
}

impl Recipe {
    /// The model the recipe asks for, to learn `tokenizer`'s tokens: a fresh model gets its
    /// vocabulary.
    ///
    /// # Errors
    /// An unreadable or unsupported checkpoint config; a vocabulary smaller than the
    /// tokenizer's; `train.seq_len` above the model's positions.
    pub fn model_config(&self, tokenizer: &kiln_hf::Tokenizer) -> Result<ModelConfig> {
        let recipe = self;
        let m = &recipe.model;
        let tokens = tokenizer.vocab_size();
        let config = match &m.from {
            Some(dir) => ModelConfig::from_dir(dir)?,
            None => {
                let sizes = Sizes {
                    vocab: tokens,
                    dim: m.dim,
                    layers: m.layers,
                    heads: m.heads,
                    context: m.context,
                };
                ModelConfig::fresh(m.kind, sizes)?
            }
        };
        let vocab = config.vocab_size();
        if vocab < tokens {
            fail!(
                Model,
                "the model's vocabulary has {vocab} tokens; the tokenizer {} needs at least {tokens}",
                tokenizer.describe()
            );
        }
        if recipe.train.seq_len > config.max_positions() {
            fail!(
                Model,
                "train.seq_len ({}) exceeds the model's {} positions",
                recipe.train.seq_len,
                config.max_positions()
            );
        }
        Ok(config)
    }
}

impl LoraRecipe {
    /// The adapters' config (seeded by the run's seed).
    pub fn config(&self, seed: u64) -> kiln_lora::LoraConfig {
        kiln_lora::LoraConfig {
            r: self.r,
            alpha: self.alpha,
            dropout: self.dropout,
            targets: self.targets.clone(),
            rslora: self.rslora,
            seed,
            qlora: self.qlora,
        }
    }
}

/// Which model, and its size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRecipe {
    /// `gpt2` or `llama` (ignored with `from`, whose `config.json` says).
    #[serde(with = "text")]
    pub kind: ModelType,
    /// Start from this Hugging Face checkpoint directory (`config.json`, `model.safetensors`)
    /// instead of a fresh model of the sizes below.
    pub from: Option<PathBuf>,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Hidden size.
    pub dim: usize,
    /// The longest sequence (GPT-2's learned positions).
    pub context: usize,
}

impl Default for ModelRecipe {
    fn default() -> Self {
        ModelRecipe {
            kind: ModelType::Gpt2,
            from: None,
            layers: 2,
            heads: 4,
            dim: 64,
            context: 64,
        }
    }
}

/// The corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataRecipe {
    /// `synthetic` (kiln's Markov-chain corpus, whose best achievable loss is known) or the path
    /// of a UTF-8 text file.
    #[serde(with = "text")]
    pub source: DataSource,
    /// Characters of synthetic text to generate.
    pub synthetic_chars: usize,
    /// Share of the corpus (its end) held out for validation.
    pub validation_fraction: f64,
    /// How text becomes tokens: `auto` (the `tokenizer.json` of `model.from` when it has one,
    /// else bytes), `bytes` (vocabulary 256), or the path of a Hugging Face `tokenizer.json`.
    #[serde(default, with = "text")]
    pub tokenizer: TokenizerSource,
}

/// Where the text comes from ([`DataRecipe::source`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DataSource {
    /// kiln's synthetic corpus.
    #[default]
    Synthetic,
    /// A UTF-8 text file.
    File(PathBuf),
}

/// How text becomes tokens ([`DataRecipe::tokenizer`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TokenizerSource {
    /// `model.from`'s `tokenizer.json` when it has one, else bytes.
    #[default]
    Auto,
    /// Bytes (vocabulary 256).
    Bytes,
    /// A Hugging Face `tokenizer.json`.
    File(PathBuf),
}

impl Default for DataRecipe {
    fn default() -> Self {
        DataRecipe {
            tokenizer: TokenizerSource::Auto,
            source: DataSource::Synthetic,
            synthetic_chars: 1 << 18,
            validation_fraction: 0.1,
        }
    }
}

/// Optimizer (AdamW), schedule (linear warmup, then cosine decay), batches and steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainRecipe {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step, over all ranks (must divide evenly among them).
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Steps of linear warmup from 0 to `lr`.
    pub warmup_steps: usize,
    /// The cosine decays to `lr * min_lr_ratio` at the last step.
    pub min_lr_ratio: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW's first-moment decay.
    pub beta1: f64,
    /// AdamW's second-moment decay.
    pub beta2: f64,
    /// Global gradient-norm clipping (0: none).
    pub grad_clip: f64,
    /// Validation every this many steps (0: only at the end).
    pub eval_every: usize,
    /// Validation batches (of `batch_size` sequences).
    pub eval_batches: usize,
    /// Seeds initialisation, batch order and sampling.
    pub seed: u64,
    /// Characters of text generated after training (0: none).
    pub sample_chars: usize,
    /// Activation rematerialisation: `off`; `balanced` (Burn's op-level checkpointing: the
    /// outputs of memory-bound ops are recomputed in backward instead of kept); or
    /// `budget=SIZE` (kiln's: activations held to SIZE bytes per rank, e.g. `budget=64MiB`,
    /// the rest recomputed when backward needs them).
    #[serde(default, with = "text")]
    pub remat: Remat,
    /// Mixed precision: `f32`; `bf16` or `f16` (compute-bound ops and ZeRO-3 parameter
    /// gathers in that dtype, f32 parameters, optimizer state and gradient reduction;
    /// `f16` with dynamic loss scaling).
    #[serde(default, with = "text")]
    pub precision: Precision,
    /// f16's initial loss scale (PyTorch `GradScaler`'s `init_scale`).
    #[serde(default = "default_loss_scale")]
    pub loss_scale: f64,
    /// f16: good steps after which the loss scale doubles (`growth_interval`).
    #[serde(default = "default_loss_scale_growth")]
    pub loss_scale_growth_interval: u32,
}

fn default_loss_scale() -> f64 {
    65536.0
}

fn default_loss_scale_growth() -> u32 {
    2000
}

impl Default for TrainRecipe {
    fn default() -> Self {
        TrainRecipe {
            steps: 300,
            batch_size: 16,
            seq_len: 64,
            lr: 3e-3,
            warmup_steps: 30,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            grad_clip: 1.0,
            eval_every: 100,
            eval_batches: 4,
            seed: 1234,
            sample_chars: 160,
            remat: Remat::Off,
            precision: Precision::F32,
            loss_scale: default_loss_scale(),
            loss_scale_growth_interval: default_loss_scale_growth(),
        }
    }
}

/// Ranks and strategy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelRecipe {
    /// `ddp`, `zero1`, `zero2`, `zero3` (or `fsdp`), `hybrid:S`.
    #[serde(with = "text")]
    pub strategy: Strategy,
    /// Ranks as threads of this process (ignored under a launcher, which sets the world size).
    pub ranks: usize,
    /// Expected world size under a launcher (0: whatever the launcher says). A mismatch is an
    /// error, not a silently different global batch.
    pub world_size: usize,
    /// Process group under a launcher: `tcp`, `nccl` (GPUs; needs the `nccl` feature) or `mpi`
    /// (a job started by `mpirun` or `srun`; needs the `mpi` feature).
    #[serde(with = "text")]
    pub backend: GroupBackend,
    /// Communication on a thread of its own, overlapping computation (gradient buckets reduced
    /// during backward, ZeRO-3 parameters prefetched). Off: blocking collectives (for
    /// measuring what overlap hides; the numbers are the same).
    #[serde(default = "yes")]
    pub overlap: bool,
    /// Gradients are reduced in buckets of this many KiB (0: a quarter of the model's
    /// parameter bytes, between 256 KiB and 25 MiB, so that even a small model's reduction
    /// starts during backward).
    #[serde(default)]
    pub bucket_kib: usize,
    /// Pipeline stages (1: none). The world is `pp` stages x data-parallel ranks; the
    /// strategy applies to each stage's data-parallel ranks.
    #[serde(default = "one")]
    pub pp: usize,
    /// Tensor-parallel ranks (1: none): each layer the plan names is split over `tp` ranks
    /// (Megatron's column/row split), the fastest axis of the mesh (one node). The world is
    /// `pp` stages x data-parallel ranks x `tp`; composes with the `ddp` strategy.
    #[serde(default = "one")]
    pub tp: usize,
    /// Which layers tensor parallelism splits how: `pattern=style` items, comma-separated
    /// (`c_attn=colwise/3,c_fc=colwise,c_proj=rowwise`; styles `colwise`, `colwise/<blocks>`,
    /// `rowwise`; a pattern without a dot matches a module path's last component, `*` any
    /// run of characters). Empty: the model's own (Megatron's split of GPT-2 or Llama).
    #[serde(default)]
    pub tp_plan: String,
    /// Megatron's sequence parallelism with `tp > 1`: between the split layers (norms,
    /// residuals) activations are split along the tokens over the tp ranks, dividing their
    /// memory by tp; the all-reduces become all-gathers and reduce-scatters.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Micro-batches per step of a pipeline (each data-parallel rank's rows are cut into them).
    #[serde(default = "one")]
    pub microbatches: usize,
    /// The pipeline's schedule: `gpipe`, `1f1b` or `interleaved:V`.
    #[serde(default = "one_f_one_b", with = "text")]
    pub schedule: ScheduleKind,
    /// Where the pipeline's chunks start, as unit names after the first chunk (`h.2,h.5`;
    /// the start of a run prints the units); `measured`: chunks balanced by each unit's forward
    /// and backward time, measured on every rank at start (the slowest rank's figure counts); or empty:
    /// chunks balanced by parameter count.
    #[serde(default, with = "text")]
    pub split: Split,
}

/// The process group under a launcher ([`ParallelRecipe::backend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBackend {
    /// TCP between processes (CPU).
    Tcp,
    /// NCCL (GPUs; the `nccl` feature).
    Nccl,
    /// MPI (a job started by `mpirun` or `srun`; the `mpi` feature).
    Mpi,
}

impl GroupBackend {
    /// The name `kiln_comm::join` takes.
    pub fn name(self) -> &'static str {
        match self {
            GroupBackend::Tcp => "tcp",
            GroupBackend::Nccl => "nccl",
            GroupBackend::Mpi => "mpi",
        }
    }
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}

fn one_f_one_b() -> ScheduleKind {
    ScheduleKind::OneFOneB
}

impl Default for ParallelRecipe {
    fn default() -> Self {
        ParallelRecipe {
            strategy: Strategy::Ddp,
            ranks: 1,
            world_size: 0,
            backend: GroupBackend::Tcp,
            overlap: true,
            bucket_kib: 0,
            pp: 1,
            tp: 1,
            tp_plan: String::new(),
            sequence_parallel: false,
            microbatches: 1,
            schedule: one_f_one_b(),
            split: Split::Balanced,
        }
    }
}

/// Outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputRecipe {
    /// The run directory: `metrics.jsonl`, `recipe.toml`, `snapshots/`.
    pub dir: PathBuf,
    /// A snapshot every this many steps (0: only at the end).
    pub snapshot_every: usize,
    /// Snapshots kept (the oldest are deleted once a newer one is complete).
    pub keep: usize,
    /// Also a snapshot in this machine's memory (`/dev/shm`) every this many steps (0: none):
    /// it outlives the ranks' processes, so a restart after a crash (`kiln launch
    /// --max-restarts`, or `--resume`) recomputes at most this many steps instead of a disk
    /// snapshot interval. Only the newest is kept; every rank must be on this machine.
    #[serde(default)]
    pub memory_snapshot_every: usize,
    /// Progress lines when stdout is not a terminal: this many over the run.
    pub progress_lines: usize,
}

impl Default for OutputRecipe {
    fn default() -> Self {
        OutputRecipe {
            dir: PathBuf::from("runs/kiln"),
            snapshot_every: 100,
            keep: 2,
            memory_snapshot_every: 0,
            progress_lines: 20,
        }
    }
}

/// The default recipe, as TOML with comments: `kiln train --print-recipe` writes it.
pub const DEFAULT_TOML: &str = include_str!("default_recipe.toml");

impl Recipe {
    /// Reads `path` (or the default recipe when `None`) and applies `overrides` (`a.b=value`; the
    /// value is a TOML literal, or else a string).
    ///
    /// # Errors
    /// A missing or unreadable file, invalid TOML, an unknown key (named), a value of the wrong
    /// type, an inconsistent setting (see [`Recipe::validate`]).
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Recipe> {
        let (text, origin) = Recipe::read(path)?;
        Recipe::parse(&text, &origin, overrides)
    }

    /// The text of the recipe at `path` (the default recipe's when `None`) and where it came
    /// from, for [`Recipe::parse`].
    ///
    /// # Errors
    /// A missing or unreadable file.
    pub fn read(path: Option<&Path>) -> Result<(String, String)> {
        Ok(match path {
            Some(p) => (
                std::fs::read_to_string(p)
                    .io(|| format!("cannot read the recipe {}", p.display()))?,
                p.display().to_string(),
            ),
            None => (DEFAULT_TOML.to_string(), "the default recipe".to_string()),
        })
    }

    /// A recipe from its TOML `text` (read from `origin`, named in errors) with `overrides`
    /// applied (`a.b=value`; the value is a TOML literal, or else a string).
    ///
    /// # Errors
    /// Invalid TOML, an unknown key (named), a value of the wrong type, an inconsistent setting
    /// (see [`Recipe::validate`]).
    pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Recipe> {
        let (text, origin) = (text.to_string(), origin.to_string());
        let mut doc: toml::Table =
            toml::from_str(&text).map_err(|e| TrainError::Recipe(format!("{origin}: {e}")))?;
        for o in overrides {
            apply_override(&mut doc, o)?;
        }
        // Deserialising text (not the table) keeps spans: errors quote the offending line.
        let (text, origin) = if overrides.is_empty() {
            (text, origin)
        } else {
            (
                toml::to_string(&doc).expect("a table serialises"),
                format!("{origin} with the overrides {overrides:?}"),
            )
        };
        let recipe: Recipe =
            toml::from_str(&text).map_err(|e| TrainError::Recipe(format!("{origin}: {e}")))?;
        recipe.validate()?;
        Ok(recipe)
    }

    /// Checks the settings that do not depend on the world size.
    ///
    /// # Errors
    /// The setting and why.
    pub fn validate(&self) -> Result<()> {
        let t = &self.train;
        let m = &self.model;
        if t.steps == 0 || t.batch_size == 0 || t.seq_len == 0 {
            fail!(
                Recipe,
                "train.steps ({}), train.batch_size ({}) and train.seq_len ({}) must be > 0",
                t.steps,
                t.batch_size,
                t.seq_len
            );
        }
        if m.from.is_none() {
            if m.heads == 0 || !m.dim.is_multiple_of(m.heads) {
                fail!(
                    Recipe,
                    "model.dim ({}) must be a multiple of model.heads ({})",
                    m.dim,
                    m.heads
                );
            }
            if t.seq_len > m.context {
                fail!(
                    Recipe,
                    "train.seq_len ({}) exceeds model.context ({})",
                    t.seq_len,
                    m.context
                );
            }
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            fail!(Recipe, "train.lr must be > 0, got {}", t.lr);
        }
        if let Some(l) = &self.lora {
            if m.from.is_none() {
                fail!(
                    Recipe,
                    "LoRA fine-tunes a pretrained base: set model.from (kiln finetune --base DIR)"
                );
            }
            if l.adapter.is_none() && (l.r == 0 || l.targets.is_empty()) {
                fail!(
                    Recipe,
                    "lora.r ({}) must be > 0 and lora.targets ({:?}) not empty",
                    l.r,
                    l.targets
                );
            }
        }
        if !(0.0..1.0).contains(&self.data.validation_fraction) {
            fail!(
                Recipe,
                "data.validation_fraction must be in [0, 1), got {}",
                self.data.validation_fraction
            );
        }
        if self.output.keep == 0 {
            fail!(Recipe, "output.keep must be at least 1");
        }
        if !(self.train.loss_scale.is_finite() && self.train.loss_scale > 0.0) {
            fail!(
                Recipe,
                "train.loss_scale must be a positive number, got {}",
                self.train.loss_scale
            );
        }
        if self.train.loss_scale_growth_interval == 0 {
            fail!(
                Recipe,
                "train.loss_scale_growth_interval must be at least 1"
            );
        }
        Ok(())
    }

    /// Checks the settings against the world size.
    ///
    /// # Errors
    /// A batch that does not split evenly, a hybrid shard size that does not divide the world, a
    /// launcher's world size other than `parallel.world_size`.
    pub fn check_world(&self, world: usize, launched: bool) -> Result<()> {
        if launched && self.parallel.world_size != 0 && self.parallel.world_size != world {
            fail!(
                World,
                "the recipe expects parallel.world_size = {} but the launcher started {world} ranks",
                self.parallel.world_size
            );
        }
        let p = &self.parallel;
        if p.pp == 0 || !world.is_multiple_of(p.pp) {
            fail!(
                World,
                "parallel.pp ({}) must divide the world size ({world}): the world is pp stages x \
                 data-parallel ranks",
                p.pp
            );
        }
        if p.tp == 0 || !(world / p.pp).is_multiple_of(p.tp) {
            fail!(
                World,
                "parallel.tp ({}) must divide the ranks of a stage ({} = {world} ranks / {} \
                 stages): the world is pp stages x data-parallel ranks x tp ranks",
                p.tp,
                world / p.pp,
                p.pp
            );
        }
        let dp = world / p.pp / p.tp;
        if !self.train.batch_size.is_multiple_of(dp) {
            let ranks = match (p.pp, p.tp) {
                (1, 1) => format!("the world size ({world})"),
                (pp, tp) => format!(
                    "the data-parallel ranks ({dp} = {world} ranks / {pp} stages / {tp} tp ranks)"
                ),
            };
            fail!(
                World,
                "train.batch_size ({}) must be a multiple of {ranks}: each rank takes an equal \
                 share of the global batch",
                self.train.batch_size
            );
        }
        if p.pp > 1 {
            let rows = self.train.batch_size / dp;
            if p.microbatches == 0 || !rows.is_multiple_of(p.microbatches) {
                fail!(
                    World,
                    "parallel.microbatches ({}) must divide each data-parallel rank's {rows} rows \
                     (train.batch_size {} over {dp} ranks)",
                    p.microbatches,
                    self.train.batch_size
                );
            }
        }
        if let Strategy::Hybrid { shard_size } = self.parallel.strategy
            && (shard_size == 0 || !dp.is_multiple_of(shard_size))
        {
            fail!(
                World,
                "parallel.strategy hybrid:{shard_size} needs data-parallel ranks divisible by \
                 {shard_size}, got {dp}"
            );
        }
        Ok(())
    }

    /// The recipe as TOML (written next to the run's outputs).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a recipe serialises")
    }
}

fn apply_override(doc: &mut toml::Table, assignment: &str) -> Result<()> {
    let Some((key, value)) = assignment.split_once('=') else {
        fail!(
            Recipe,
            "override '{assignment}' is not key=value (e.g. train.lr=1e-3)"
        );
    };
    let key = key.trim();
    let value = value.trim();
    // A TOML literal (number, bool, quoted string, array), or else a bare string.
    let parsed: toml::Value = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let parts: Vec<&str> = key.split('.').collect();
    let (last, tables) = parts.split_last().expect("split yields one part");
    let mut table = doc;
    for part in tables {
        let entry = table
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(Default::default()));
        table = match entry {
            toml::Value::Table(t) => t,
            _ => fail!(Recipe, "override '{assignment}': '{part}' is not a table"),
        };
    }
    table.insert(last.to_string(), parsed);
    Ok(())
}

/// `train.remat` as a recipe writes it (`budget=64MiB`).
pub(crate) fn remat_text(remat: &Remat) -> String {
    remat.text()
}

/// A recipe value written as text: parsed once, when the recipe is read (an unknown value is
/// an error naming the accepted ones, with the line), and written back the same way.
trait Text: Sized {
    fn parse(s: &str) -> std::result::Result<Self, String>;
    fn text(&self) -> String;
}

/// `#[serde(with = "text")]` for a [`Text`] value.
mod text {
    use super::Text;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: Text, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&value.text())
    }

    pub fn deserialize<'de, T: Text, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        let s = String::deserialize(d)?;
        T::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl Text for ModelType {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        ModelType::from_name(s)
            .ok_or_else(|| format!("model.kind '{s}': expected {}", ModelType::names()))
    }
    fn text(&self) -> String {
        self.name().into()
    }
}

impl Text for DataSource {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "synthetic" => DataSource::Synthetic,
            path => DataSource::File(PathBuf::from(path)),
        })
    }
    fn text(&self) -> String {
        match self {
            DataSource::Synthetic => "synthetic".into(),
            DataSource::File(p) => p.display().to_string(),
        }
    }
}

impl Text for TokenizerSource {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "auto" => TokenizerSource::Auto,
            "bytes" => TokenizerSource::Bytes,
            path => TokenizerSource::File(PathBuf::from(path)),
        })
    }
    fn text(&self) -> String {
        match self {
            TokenizerSource::Auto => "auto".into(),
            TokenizerSource::Bytes => "bytes".into(),
            TokenizerSource::File(p) => p.display().to_string(),
        }
    }
}

impl Text for Remat {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        s.parse()
            .map_err(|_| format!("train.remat must be {}, got {s:?}", Remat::FORMS))
    }
    fn text(&self) -> String {
        match self {
            Remat::Budget(bytes) => format!("budget={}", crate::report::size(*bytes)),
            other => other.to_string(),
        }
    }
}

impl Text for Precision {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        Precision::from_name(s).ok_or_else(|| {
            format!("train.precision must be \"f32\", \"bf16\" or \"f16\", got \"{s}\"")
        })
    }
    fn text(&self) -> String {
        self.name().into()
    }
}

impl Text for Strategy {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        s.parse().map_err(|e: kiln_shard::ShardError| e.to_string())
    }
    fn text(&self) -> String {
        match self {
            Strategy::Hybrid { shard_size } => format!("hybrid:{shard_size}"),
            other => other.to_string(),
        }
    }
}

impl Text for GroupBackend {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        [GroupBackend::Tcp, GroupBackend::Nccl, GroupBackend::Mpi]
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("parallel.backend '{s}': expected tcp, nccl or mpi"))
    }
    fn text(&self) -> String {
        self.name().into()
    }
}

impl Text for ScheduleKind {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        s.parse()
            .map_err(|e: kiln_pipe::PipeError| format!("parallel.schedule: {e}"))
    }
    fn text(&self) -> String {
        self.to_string()
    }
}

impl Text for Split {
    fn parse(s: &str) -> std::result::Result<Self, String> {
        Ok(match s.trim() {
            "" => Split::Balanced,
            "measured" => Split::Measured,
            s => Split::At(s.split(',').map(|u| u.trim().to_string()).collect()),
        })
    }
    fn text(&self) -> String {
        match self {
            Split::Balanced | Split::Costs(_) => String::new(),
            Split::Measured => "measured".into(),
            Split::At(units) => units.join(","),
            #[allow(unreachable_patterns)]
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_and_unknown_ones_are_named() {
        let with = |p: &str| Recipe::load(None, &[format!("train.precision={p:?}")]);
        assert_eq!(with("bf16").unwrap().train.precision, Precision::BF16);
        assert_eq!(with("f16").unwrap().train.precision, Precision::F16);
        assert_eq!(
            Recipe::load(None, &[]).unwrap().train.precision,
            Precision::F32
        );
        let e = with("fp8").unwrap_err().to_string();
        assert!(e.contains("train.precision") && e.contains("fp8"), "{e}");
        let e = Recipe::load(None, &["train.loss_scale=0.0".to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.loss_scale must be a positive number"),
            "{e}"
        );
    }

    #[test]
    fn remat_modes_and_sizes_parse() {
        assert_eq!("off".parse::<Remat>().unwrap(), Remat::Off);
        assert_eq!("balanced".parse::<Remat>().unwrap(), Remat::Balanced);
        assert_eq!(
            "budget=64MiB".parse::<Remat>().unwrap(),
            Remat::Budget(64 << 20)
        );
        assert_eq!(
            "budget=1.5G".parse::<Remat>().unwrap(),
            Remat::Budget(3 << 29)
        );
        assert_eq!("budget=4096".parse::<Remat>().unwrap(), Remat::Budget(4096));
        for bad in ["budget=", "budget=lots", "budget=-1M", "sometimes"] {
            let e = bad.parse::<Remat>().unwrap_err().to_string();
            assert!(e.contains("budget=SIZE") && e.contains(bad), "{e}");
        }
        assert_eq!(kiln::parse_size("512 KiB"), Some(512 << 10));
        for r in [
            Remat::Off,
            Remat::Balanced,
            Remat::Budget(64 << 20),
            Remat::Budget(4097),
        ] {
            assert_eq!(Remat::parse(&r.text()).unwrap(), r, "{}", r.text());
        }
        let e = Recipe::load(None, &["train.remat=\"sometimes\"".into()]).unwrap_err();
        assert!(format!("{e:#}").contains("train.remat must be"), "{e:#}");
    }

    #[test]
    fn the_default_file_is_the_default_struct() {
        let parsed = Recipe::load(None, &[]).unwrap();
        let defaults = Recipe {
            model: ModelRecipe::default(),
            data: DataRecipe::default(),
            train: TrainRecipe::default(),
            parallel: ParallelRecipe::default(),
            output: OutputRecipe::default(),
            lora: None,
        };
        assert_eq!(parsed, defaults);
    }

    #[test]
    fn overrides_apply_and_typos_are_named() {
        let r = Recipe::load(
            None,
            &["train.lr=0.5".into(), "parallel.strategy=zero3".into()],
        )
        .unwrap();
        assert_eq!(r.train.lr, 0.5);
        assert_eq!(r.parallel.strategy, Strategy::Zero3);
        let r = Recipe::load(None, &["parallel.strategy=\"hybrid:2\"".into()]).unwrap();
        let back: Recipe = toml::from_str(&r.to_toml()).unwrap();
        assert_eq!(back, r);
        let e = Recipe::load(None, &["train.stpes=3".into()]).unwrap_err();
        assert!(format!("{e:#}").contains("stpes"), "{e:#}");
        let e = Recipe::load(None, &["train.steps=many".into()]).unwrap_err();
        assert!(format!("{e:#}").contains("steps"), "{e:#}");
        let e = Recipe::load(None, &["parallel.strategy=zero9".into()]).unwrap_err();
        assert!(format!("{e:#}").contains("zero9"), "{e:#}");
    }

    #[test]
    fn the_world_must_fit_the_batch_and_degrees() {
        let r = Recipe::load(None, &["parallel.strategy=hybrid:3".into()]).unwrap();
        let e = r.check_world(4, false).unwrap_err().to_string();
        assert!(e.contains("hybrid:3") && e.contains('4'), "{e}");
        let r = Recipe::load(None, &["train.batch_size=6".into()]).unwrap();
        let e = r.check_world(4, false).unwrap_err().to_string();
        assert!(e.contains("(6)") && e.contains("(4)"), "{e}");
        let r = Recipe::load(None, &["parallel.world_size=2".into()]).unwrap();
        let e = r.check_world(4, true).unwrap_err().to_string();
        assert!(
            e.contains("world_size = 2") && e.contains("started 4"),
            "{e}"
        );
    }
}
