//! Snapshots: every rank writes its own pieces, rank 0 a manifest; any world size and strategy
//! reads them back.
//!
//! Layout of `OUT/snapshots/`:
//! - `step-00000100/manifest.json`: step, world size, strategy, model, data position, and for
//!   every tensor its logical shape and the pieces (file, key, element range of the flattened
//!   tensor) that cover it, with each file's size and CRC32;
//! - `step-00000100/rank-00003.safetensors`: rank 3's pieces, 1-D f32 tensors;
//! - `latest`: the name of the newest complete snapshot.
//!
//! A tensor held whole by every rank (DDP parameters) is split among the ranks that hold it, and a
//! shard replicated across groups (hybrid) among its replicas, so each element is written once
//! and the writing is spread over the job.
//!
//! Atomicity: ranks write into `.step-00000100.partial/` (each file written under a temporary name,
//! synced, then renamed); after a barrier rank 0 checks every rank's file, writes the manifest the
//! same way, renames the directory to `step-00000100` and only then replaces `latest`. A crash at
//! any point leaves `latest` naming the previous, complete snapshot.
//!
//! Asynchronous writing ([`set_asynchronous`], which `kiln train` turns on; PyTorch DCP's
//! `async_save`): [`save`] takes the pieces (already copied to host memory by the caller), makes
//! the partial directory (a barrier only at a run's first save, where rank 0 clears what a
//! crashed run left) and returns; a thread of the rank serialises,
//! writes and syncs its file, and rank 0's thread then waits for every rank's index file
//! (written last, atomically) instead of a barrier, and completes the snapshot as above. No
//! collective runs off the training thread. [`flush`] waits for the writes (and reports their
//! errors); the next `save` flushes first, and a run must flush before it ends. Resharding needs no
//! communication: a rank reads the range it holds under the new layout from the pieces that
//! cover it (PyTorch DCP's approach), which needs the directory to be visible to every rank
//! (one machine, or a shared filesystem across nodes).

use crate::error::{IoContext, Result, TrainError, fail};
use kiln_comm::ProcessGroup;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The manifest's format version.
pub const FORMAT: u32 = 1;
/// The file naming the newest complete snapshot.
pub const LATEST: &str = "latest";
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";

/// What a snapshot holds besides tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Optimizer steps taken.
    pub step: usize,
    /// The model (`gpt2` or `llama`).
    pub model_kind: String,
    /// The model's config, as `config.json` would hold it.
    pub model_config: serde_json::Value,
    /// The strategy that wrote it.
    pub strategy: String,
    /// The world size that wrote it.
    pub world_size: usize,
    /// The batch sampler's state after `step` steps.
    pub data_rng: u64,
    /// AdamW's step count (its bias correction).
    pub optimizer_time: usize,
    /// The dynamic loss scale and its good steps since the last change (f16 training).
    #[serde(default)]
    pub loss_scale: Option<(f64, u32)>,
    /// The recipe, as TOML (for the record; a resumed run uses the one it is given).
    pub recipe: String,
}

/// One piece of a tensor in a rank's file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceRef {
    /// The file, relative to the snapshot directory.
    pub file: String,
    /// The tensor's key in that file.
    pub key: String,
    /// First element (of the flattened tensor).
    pub start: usize,
    /// One past the last element.
    pub end: usize,
}

/// A tensor of the snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Its logical shape.
    pub shape: Vec<usize>,
    /// Pieces covering `0..numel` exactly once.
    pub pieces: Vec<PieceRef>,
}

/// A file of the snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC32 of its bytes.
    pub crc32: u32,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// Step, model, data position, ...
    pub meta: Meta,
    /// Tensors by name (`model/<path>`, `adamw.m1/<path>`, `adamw.m2/<path>`).
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Files by name.
    pub files: BTreeMap<String, FileEntry>,
}

/// What one rank writes of one tensor.
#[derive(Debug, Clone)]
pub struct Part {
    /// Tensor name.
    pub name: String,
    /// Its logical shape.
    pub shape: Vec<usize>,
    /// First element written.
    pub start: usize,
    /// The values of `start..start + values.len()`.
    pub values: Vec<f32>,
}

/// What each rank reports to rank 0 (`rank-NNNNN.json`).
#[derive(Debug, Serialize, Deserialize)]
struct RankIndex {
    file: String,
    bytes: u64,
    crc32: u32,
    parts: Vec<(String, Vec<usize>, PieceRef)>,
}

/// The sub-range of `held` that copy `copy` of `copies` identical holders writes.
pub fn share(held: Range<usize>, copies: usize, copy: usize) -> Range<usize> {
    let r = kiln_comm::shard_range(held.len(), copies, copy);
    held.start + r.start..held.start + r.end
}

pub(crate) fn step_dir(step: usize) -> String {
    format!("step-{step:08}")
}

/// The step of a snapshot directory (`step-NNNNNNNN`), from its name.
pub(crate) fn step_of(dir: &Path) -> Option<usize> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

/// Writes `bytes` to `path` atomically: a temporary file, synced, renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).io(|| format!("cannot create {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .io(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).io(|| format!("cannot rename to {}", path.display()))?;
    Ok(())
}

fn sync_dir(dir: &Path) {
    // Makes renames durable; not supported everywhere, and not needed for correctness on a crash
    // of the process only, so failures are ignored.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// For tests of crash safety: `KILN_TEST_ABORT_IN_SNAPSHOT=STEP` makes rank 0 abort the
/// process after writing half of its file of that step's snapshot, in the job's first start
/// only (not in a restart by `kiln launch --max-restarts`, `KILN_RESTART_COUNT` > 0).
fn abort_requested(step: usize, rank: usize) -> bool {
    rank == 0
        && std::env::var("KILN_RESTART_COUNT").map_or(true, |n| n.trim() == "0")
        && std::env::var("KILN_TEST_ABORT_IN_SNAPSHOT")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            == Some(step)
}

static ASYNCHRONOUS: AtomicBool = AtomicBool::new(false);

/// A write under way: the snapshot root, the rank, the thread writing.
type Pending = (PathBuf, usize, JoinHandle<Result<()>>);

/// Writes still under way.
static PENDING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());

/// The (root, rank) pairs that saved asynchronously in this process.
static SAVED: Mutex<Vec<(PathBuf, usize)>> = Mutex::new(Vec::new());

/// Whether this is `rank`'s first asynchronous save under `root` in this process.
fn first_save(root: &Path, rank: usize) -> bool {
    let mut saved = SAVED.lock().unwrap_or_else(PoisonError::into_inner);
    let first = !saved.iter().any(|(r, k)| r == root && *k == rank);
    if first {
        saved.push((root.to_path_buf(), rank));
    }
    first
}

/// The partial directories (`.step-*.partial`) under `root`.
pub(crate) fn partial_dirs(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(".step-") && n.ends_with(".partial"))
        })
        .map(|e| e.path())
        .collect()
}

/// Makes [`save`] return before its files are written (see the module doc); off by default,
/// since the caller must then [`flush`] before it relies on the snapshot or exits.
pub fn set_asynchronous(on: bool) {
    ASYNCHRONOUS.store(on, Ordering::Release);
}

/// Whether [`save`] writes asynchronously.
pub fn asynchronous() -> bool {
    ASYNCHRONOUS.load(Ordering::Acquire)
}

/// Waits for every snapshot write of this process still under way (each rank's file; rank 0's
/// completion of the snapshot, which waits for every rank's file); the first error among
/// them. Call it before exiting, and before reading a snapshot just saved.
///
/// # Errors
/// A write that failed, or a rank whose file did not come within its group's timeout.
pub fn flush() -> Result<()> {
    flush_where(|_, _| true)
}

/// Hands a write under way (`root`, the rank, its thread) to [`flush`].
pub(crate) fn pend(root: &Path, rank: usize, handle: JoinHandle<Result<()>>) {
    PENDING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((root.to_path_buf(), rank, handle));
}

pub(crate) fn flush_where(select: impl Fn(&Path, usize) -> bool) -> Result<()> {
    let mine: Vec<JoinHandle<Result<()>>> = {
        let mut pending = PENDING.lock().unwrap_or_else(PoisonError::into_inner);
        let (mine, rest) = std::mem::take(&mut *pending)
            .into_iter()
            .partition(|(root, rank, _)| select(root, *rank));
        *pending = rest;
        mine.into_iter().map(|(_, _, h)| h).collect()
    };
    let mut first = Ok(());
    for h in mine {
        let result = h.join().unwrap_or_else(|_| {
            Err(TrainError::Snapshot(
                "the thread writing a snapshot panicked".into(),
            ))
        });
        if first.is_ok() {
            first = result;
        }
    }
    first
}

/// Writes this rank's `parts` as part of snapshot `meta.step` under `root`; every rank of `group`
/// must call it. Rank 0 completes the snapshot and deletes all but the newest `keep`.
/// Returns the snapshot's directory. Asynchronously ([`set_asynchronous`]) the directory is
/// complete only once [`flush`] has returned; this rank's previous write is flushed first.
///
/// # Errors
/// A file that cannot be written, a rank whose file is missing or damaged, a failed collective;
/// asynchronously, the previous write's errors (this one's come from the next `save` or
/// [`flush`]).
pub fn save(
    root: &Path,
    meta: &Meta,
    parts: Vec<Part>,
    group: &dyn ProcessGroup,
    keep: usize,
) -> Result<PathBuf> {
    save_as(root, meta, parts, group, keep, asynchronous())
}

fn save_as(
    root: &Path,
    meta: &Meta,
    parts: Vec<Part>,
    group: &dyn ProcessGroup,
    keep: usize,
    asynchronous: bool,
) -> Result<PathBuf> {
    let rank = group.rank();
    flush_where(|r, k| r == root && k == rank)?;
    let name = step_dir(meta.step);
    let partial = root.join(format!(".{name}.partial"));
    let done = root.join(&name);
    // A partial directory left by an earlier, crashed attempt must go before any rank writes
    // into this one: synchronously, rank 0 removes it while the others wait. Asynchronously,
    // rank 0 removes every stale partial directory at this rank's first save under `root`
    // (all ranks' first saves are of the same step, so they all wait there); the partial
    // directories of later saves are this run's own, and each rank makes it without waiting.
    let first = !asynchronous || first_save(root, rank);
    if rank == 0 && first {
        let stale: Vec<PathBuf> = if asynchronous {
            partial_dirs(root)
        } else {
            vec![partial.clone()]
        };
        for dir in stale.iter().filter(|d| d.exists()) {
            std::fs::remove_dir_all(dir).io(|| format!("cannot remove {}", dir.display()))?;
        }
    }
    if rank == 0 || !first {
        std::fs::create_dir_all(&partial).io(|| format!("cannot create {}", partial.display()))?;
    }
    if first {
        group.barrier()?;
    }
    let job = SnapshotWrite {
        root: root.to_path_buf(),
        meta: meta.clone(),
        partial,
        done: done.clone(),
        rank,
        world: group.world_size(),
        keep,
    };
    if asynchronous {
        // Rank 0 waits for the others' files as long as a collective would wait for them.
        let wait = group.timeout();
        let handle = std::thread::Builder::new()
            .name(format!("kiln-snapshot-{rank}"))
            .spawn(move || {
                job.write_pieces(parts)?;
                if job.rank == 0 {
                    job.await_ranks(wait)?;
                    job.complete()?;
                }
                Ok(())
            })
            .io(|| "cannot start the thread that writes the snapshot".to_string())?;
        PENDING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((root.to_path_buf(), rank, handle));
        return Ok(done);
    }
    job.write_pieces(parts)?;
    group.barrier()?;
    if rank == 0 {
        job.complete()?;
    }
    group.barrier()?;
    Ok(done)
}

/// Rank `rank`'s file of a snapshot: its name, its bytes (safetensors, one 1-D f32 tensor per
/// part) and its index (`rank-NNNNN.json`'s bytes).
pub(crate) fn serialize(rank: usize, parts: Vec<Part>) -> Result<(String, Vec<u8>, Vec<u8>)> {
    let file = format!("rank-{rank:05}.safetensors");
    let mut index = RankIndex {
        file: file.clone(),
        bytes: 0,
        crc32: 0,
        parts: Vec::new(),
    };
    let mut buffers: Vec<(String, Vec<u8>, usize)> = Vec::new();
    for (i, p) in parts.into_iter().enumerate() {
        if p.values.is_empty() {
            continue;
        }
        let key = format!("t{i}");
        index.parts.push((
            p.name,
            p.shape,
            PieceRef {
                file: file.clone(),
                key: key.clone(),
                start: p.start,
                end: p.start + p.values.len(),
            },
        ));
        let len = p.values.len();
        buffers.push((key, bytemuck_f32(&p.values), len));
    }
    let views: Vec<(String, TensorView)> = buffers
        .iter()
        .map(|(k, b, len)| {
            (
                k.clone(),
                TensorView::new(Dtype::F32, vec![*len], b).expect("a 1-D f32 view"),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, None).map_err(|e| {
        TrainError::Snapshot(format!("cannot serialise rank {rank}'s snapshot file: {e}"))
    })?;
    index.bytes = bytes.len() as u64;
    index.crc32 = crc32fast::hash(&bytes);
    let index = serde_json::to_vec(&index).expect("an index serialises");
    Ok((file, bytes, index))
}

/// One rank's part of writing one snapshot.
#[derive(Debug)]
pub(crate) struct SnapshotWrite {
    pub root: PathBuf,
    pub meta: Meta,
    pub partial: PathBuf,
    pub done: PathBuf,
    pub rank: usize,
    pub world: usize,
    pub keep: usize,
}

impl SnapshotWrite {
    /// This rank's file and, last, its index (`rank-NNNNN.json`), each atomically.
    fn write_pieces(&self, parts: Vec<Part>) -> Result<()> {
        let rank = self.rank;
        let (file, bytes, index) = serialize(rank, parts)?;
        if abort_requested(self.meta.step, rank) {
            let path = self.partial.join(&file);
            std::fs::File::create(&path)
                .and_then(|mut f| {
                    f.write_all(&bytes[..bytes.len() / 2])?;
                    f.sync_all()
                })
                .io(|| format!("cannot write {}", path.display()))?;
            tracing::warn!(
                "KILN_TEST_ABORT_IN_SNAPSHOT: aborting while writing {}",
                path.display()
            );
            std::process::abort();
        }
        write_atomic(&self.partial.join(&file), &bytes)?;
        write_atomic(&self.partial.join(format!("rank-{rank:05}.json")), &index)
    }

    /// Rank 0, asynchronously: waits until every rank's index file is there (each is renamed
    /// into place after its rank's file is synced), up to `wait`.
    fn await_ranks(&self, wait: Duration) -> Result<()> {
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(1);
        loop {
            let missing: Vec<usize> = (0..self.world)
                .filter(|r| !self.partial.join(format!("rank-{r:05}.json")).exists())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                fail!(
                    Snapshot,
                    "ranks {missing:?} did not write their part of the snapshot of step {} \
                     within {wait:?}; {} stays the latest",
                    self.meta.step,
                    LATEST
                );
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Rank 0: checks every rank's file, writes the manifest, renames the directory into
    /// place, then points `latest` at it and prunes.
    pub(crate) fn complete(&self) -> Result<()> {
        let (partial, done, root) = (&self.partial, &self.done, &self.root);
        let mut manifest = Manifest {
            format: FORMAT,
            meta: self.meta.clone(),
            tensors: BTreeMap::new(),
            files: BTreeMap::new(),
        };
        for r in 0..self.world {
            let path = partial.join(format!("rank-{r:05}.json"));
            let text = std::fs::read_to_string(&path)
                .io(|| format!("rank {r} did not finish its snapshot file"))?;
            let index: RankIndex = serde_json::from_str(&text)
                .map_err(|e| TrainError::Snapshot(format!("{} is damaged: {e}", path.display())))?;
            let on_disk = std::fs::metadata(partial.join(&index.file))
                .map(|m| m.len())
                .unwrap_or(0);
            if on_disk != index.bytes {
                fail!(
                    Snapshot,
                    "rank {r}'s snapshot file has {on_disk} bytes, it wrote {}",
                    index.bytes
                );
            }
            manifest.files.insert(
                index.file.clone(),
                FileEntry {
                    bytes: index.bytes,
                    crc32: index.crc32,
                },
            );
            for (name, shape, piece) in index.parts {
                manifest
                    .tensors
                    .entry(name)
                    .or_insert_with(|| TensorEntry {
                        shape,
                        pieces: Vec::new(),
                    })
                    .pieces
                    .push(piece);
            }
            std::fs::remove_file(&path).ok();
        }
        for (name, t) in &mut manifest.tensors {
            t.pieces.sort_by_key(|p| p.start);
            check_coverage(name, t)?;
        }
        write_atomic(
            &partial.join(MANIFEST),
            serde_json::to_string_pretty(&manifest)
                .expect("a manifest serialises")
                .as_bytes(),
        )?;
        sync_dir(partial);
        if done.exists() {
            // A snapshot of the same step from an earlier attempt: this one replaces it.
            std::fs::remove_dir_all(done).io(|| format!("cannot replace {}", done.display()))?;
        }
        std::fs::rename(partial, done)
            .io(|| format!("cannot rename {} to {}", partial.display(), done.display()))?;
        sync_dir(root);
        let name = step_dir(self.meta.step);
        write_atomic(&root.join(LATEST), name.as_bytes())?;
        sync_dir(root);
        prune(root, self.keep);
        Ok(())
    }
}

fn bytemuck_f32(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn check_coverage(name: &str, t: &TensorEntry) -> Result<()> {
    let numel: usize = t.shape.iter().product();
    let mut next = 0;
    for p in &t.pieces {
        if p.start != next {
            fail!(
                Snapshot,
                "tensor '{name}': elements {next}..{} are in no piece (or in two)",
                p.start
            );
        }
        next = p.end;
    }
    if next != numel {
        fail!(
            Snapshot,
            "tensor '{name}' has {numel} elements, its pieces cover {next}"
        );
    }
    Ok(())
}

/// Complete snapshots under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(usize, PathBuf)> {
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let step = step_of(&e.path())?;
            e.path().join(MANIFEST).exists().then(|| (step, e.path()))
        })
        .collect();
    found.sort();
    found
}

fn prune(root: &Path, keep: usize) {
    let all = list(root);
    for (_, dir) in &all[..all.len().saturating_sub(keep)] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The newest complete snapshot under `root` (the one `latest` names), if any.
///
/// # Errors
/// `latest` names a snapshot that does not exist.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    match std::fs::read_to_string(root.join(LATEST)) {
        Ok(name) => {
            let dir = root.join(name.trim());
            if !dir.join(MANIFEST).exists() {
                fail!(
                    Snapshot,
                    "{} names {}, which has no {MANIFEST}",
                    root.join(LATEST).display(),
                    dir.display()
                );
            }
            Ok(Some(dir))
        }
        // No pointer: the newest complete snapshot (a directory copied without it, say).
        Err(_) => Ok(list(root).pop().map(|(_, d)| d)),
    }
}

/// A snapshot opened for reading. Files are read (and checked against their CRC32) when a
/// tensor first needs them.
#[derive(Debug)]
pub struct Snapshot {
    dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    files: RefCell<HashMap<String, LoadedFile>>,
}

/// A rank file's bytes and where each tensor's data lies in them.
#[derive(Debug)]
struct LoadedFile {
    bytes: Vec<u8>,
    offsets: HashMap<String, (usize, usize)>,
}

impl Snapshot {
    /// Opens the snapshot directory `dir`, or the newest snapshot of the run directory `dir`.
    ///
    /// # Errors
    /// No snapshot, a missing or damaged manifest, an unknown format.
    pub fn open(dir: &Path) -> Result<Snapshot> {
        let dir = if dir.join(MANIFEST).exists() {
            dir.to_path_buf()
        } else if let Some(d) = latest(&dir.join("snapshots"))? {
            d
        } else if let Some(d) = latest(dir)? {
            d
        } else {
            fail!(
                Snapshot,
                "no snapshot in {} (expected {MANIFEST}, or a run directory with snapshots/)",
                dir.display()
            );
        };
        let path = dir.join(MANIFEST);
        let text =
            std::fs::read_to_string(&path).io(|| format!("cannot read {}", path.display()))?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| {
            TrainError::Snapshot(format!(
                "the snapshot manifest {} is damaged: {e}",
                path.display()
            ))
        })?;
        if manifest.format != FORMAT {
            fail!(
                Snapshot,
                "{} has format {}, this kiln reads format {FORMAT}",
                path.display(),
                manifest.format
            );
        }
        Ok(Snapshot {
            dir,
            manifest,
            files: RefCell::new(HashMap::new()),
        })
    }

    /// The snapshot's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The logical shape of tensor `name`.
    ///
    /// # Errors
    /// The snapshot has no such tensor.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        self.manifest
            .tensors
            .get(name)
            .map(|t| t.shape.as_slice())
            .ok_or_else(|| {
                TrainError::Snapshot(format!(
                    "the snapshot in {} has no tensor '{name}'",
                    self.dir.display()
                ))
            })
    }

    /// Elements `range` of tensor `name`, checking that its shape is `shape`.
    ///
    /// # Errors
    /// A missing tensor, another shape, a missing or corrupted file.
    pub fn read(&self, name: &str, shape: &[usize], range: Range<usize>) -> Result<Vec<f32>> {
        let found = self.shape(name)?;
        if found != shape {
            fail!(
                Snapshot,
                "tensor '{name}' is {found:?} in the snapshot {} but {shape:?} in this model: the \
                 snapshot is of a different model",
                self.dir.display()
            );
        }
        let entry = &self.manifest.tensors[name];
        let mut out = Vec::with_capacity(range.len());
        for p in &entry.pieces {
            let lo = p.start.max(range.start);
            let hi = p.end.min(range.end);
            if lo >= hi {
                continue;
            }
            self.load(&p.file)?;
            let files = self.files.borrow();
            let file = &files[&p.file];
            let &(begin, end) = file.offsets.get(&p.key).ok_or_else(|| {
                TrainError::Snapshot(format!(
                    "{} has no tensor {} (the manifest lists it)",
                    self.dir.join(&p.file).display(),
                    p.key
                ))
            })?;
            if end - begin != (p.end - p.start) * 4 {
                fail!(
                    Snapshot,
                    "{}: tensor {} has {} bytes, the manifest says {} elements",
                    self.dir.join(&p.file).display(),
                    p.key,
                    end - begin,
                    p.end - p.start
                );
            }
            let bytes = &file.bytes[begin + (lo - p.start) * 4..begin + (hi - p.start) * 4];
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        if out.len() != range.len() {
            fail!(
                Snapshot,
                "the snapshot {} covers {} of elements {range:?} of '{name}'",
                self.dir.display(),
                out.len()
            );
        }
        Ok(out)
    }

    fn load(&self, file: &str) -> Result<()> {
        if self.files.borrow().contains_key(file) {
            return Ok(());
        }
        let path = self.dir.join(file);
        let expected = self.manifest.files.get(file).ok_or_else(|| {
            TrainError::Snapshot(format!("the manifest does not list {}", path.display()))
        })?;
        let bytes = std::fs::read(&path).io(|| format!("cannot read {}", path.display()))?;
        let crc = crc32fast::hash(&bytes);
        if bytes.len() as u64 != expected.bytes || crc != expected.crc32 {
            fail!(
                Snapshot,
                "snapshot file {} is corrupted: CRC32 {crc:08x} over {} bytes where the manifest \
                 says {:08x} over {} bytes. Delete {} to resume from an earlier snapshot",
                path.display(),
                bytes.len(),
                expected.crc32,
                expected.bytes,
                self.dir.display()
            );
        }
        // The header is parsed once per file; reads then index the bytes directly.
        let (header, metadata) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| TrainError::Snapshot(format!("{}: {e}", path.display())))?;
        let offsets = metadata
            .tensors()
            .into_iter()
            .map(|(k, info)| {
                let (a, b) = info.data_offsets;
                (k, (8 + header + a, 8 + header + b))
            })
            .collect();
        self.files
            .borrow_mut()
            .insert(file.to_string(), LoadedFile { bytes, offsets });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_comm::{LocalGroup, spawn_ranks};

    fn meta(step: usize, world: usize) -> Meta {
        Meta {
            step,
            model_kind: "gpt2".into(),
            model_config: serde_json::json!({}),
            strategy: "ddp".into(),
            world_size: world,
            data_rng: 9,
            optimizer_time: step,
            loss_scale: None,
            recipe: String::new(),
        }
    }

    #[test]
    fn pieces_written_at_3_ranks_read_back_at_any_range_and_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("snapshots");
        std::fs::create_dir_all(&root).unwrap();
        let whole: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        for step in [1, 2, 3] {
            spawn_ranks(3, |g: LocalGroup| {
                // Everyone holds the whole tensor: each writes its third.
                let r = share(0..10, 3, g.rank());
                let part = Part {
                    name: "model/w".into(),
                    shape: vec![2, 5],
                    start: r.start,
                    values: whole[r].iter().map(|v| v + step as f32).collect(),
                };
                save(&root, &meta(step, 3), vec![part], &g, 2).unwrap();
            });
        }
        // Two kept, `latest` names the newest.
        assert_eq!(list(&root).len(), 2);
        let snap = Snapshot::open(dir.path()).unwrap();
        assert_eq!(snap.manifest.meta.step, 3);
        let plus3: Vec<f32> = whole.iter().map(|v| v + 3.0).collect();
        assert_eq!(snap.read("model/w", &[2, 5], 2..9).unwrap(), plus3[2..9]);
        let e = snap.read("model/w", &[5, 2], 0..1).unwrap_err().to_string();
        assert!(e.contains("different model"), "{e}");
        let e = snap.read("model/v", &[5, 2], 0..1).unwrap_err().to_string();
        assert!(e.contains("no tensor 'model/v'"), "{e}");
        // Flip a byte of one rank's file.
        let file = snap.dir().join("rank-00001.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&file, bytes).unwrap();
        let snap = Snapshot::open(dir.path()).unwrap();
        assert_eq!(snap.read("model/w", &[2, 5], 0..3).unwrap(), plus3[0..3]);
        let e = snap
            .read("model/w", &[2, 5], 0..10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank-00001.safetensors is corrupted"), "{e}");
    }

    /// Asynchronously: `save` returns before the files exist, training (here: the next save)
    /// goes on, and after `flush` the snapshots are as a synchronous save writes them.
    #[test]
    fn asynchronous_saves_complete_on_flush_and_keep_latest_complete() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("snapshots");
        std::fs::create_dir_all(&root).unwrap();
        let whole: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        spawn_ranks(2, |g: LocalGroup| {
            for step in [10, 20, 30] {
                let r = share(0..1000, 2, g.rank());
                let part = Part {
                    name: "model/w".into(),
                    shape: vec![1000],
                    start: r.start,
                    values: whole[r].iter().map(|v| v + step as f32).collect(),
                };
                let done = save_as(&root, &meta(step, 2), vec![part], &g, 2, true).unwrap();
                assert!(done.ends_with(format!("step-{step:08}")));
                // `latest` never names an incomplete snapshot.
                if let Ok(Some(latest)) = latest(&root) {
                    assert!(latest.join(MANIFEST).exists());
                }
            }
            flush_where(|_, rank| rank == g.rank()).unwrap();
        });
        flush().unwrap();
        assert_eq!(list(&root).len(), 2);
        let snap = Snapshot::open(dir.path()).unwrap();
        assert_eq!(snap.manifest.meta.step, 30);
        let plus30: Vec<f32> = whole.iter().map(|v| v + 30.0).collect();
        assert_eq!(snap.read("model/w", &[1000], 0..1000).unwrap(), plus30);
    }
}
