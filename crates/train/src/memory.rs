//! Snapshots kept in this machine's memory (`output.memory_snapshot_every`), beside the disk's.
//!
//! A rank that crashes takes its process's memory with it, and so does every rank the launcher
//! then ends; this machine's memory does not go with them. So every `memory_snapshot_every`
//! steps the ranks write a snapshot, in the same format and with the same atomic protocol as on
//! disk, under a directory of `/dev/shm` (a `tmpfs`: writing is a copy in RAM, no disk I/O;
//! asynchronous like the disk's), and keep only the newest. A run that resumes (`kiln launch
//! --max-restarts`, or `--resume`) takes the newer of the disk's and the memory's newest, so a
//! crash costs at most `memory_snapshot_every` steps of recomputation, not a disk snapshot
//! interval. The disk stays the durable copy: memory snapshots are gone with the machine (or a
//! reboot), and a run that ends removes its own.
//!
//! Where: `$KILN_MEMORY_SNAPSHOTS` if set, else `/dev/shm/kiln-<user>-<hash of the run
//! directory>` (the system's temporary directory where there is no `/dev/shm`), so a run and
//! its restarts find the same one. Every rank must be on this machine (checked at the start):
//! a copy on another node, to survive losing this one, is not made.

use crate::Recipe;
use crate::error::Result;
use crate::snapshot;
use kiln_comm::hash::fnv1a;
use std::path::{Path, PathBuf};

/// The directory of the memory snapshots of the run directory `out`.
pub fn root(out: &Path) -> PathBuf {
    if let Some(dir) = std::env::var_os("KILN_MEMORY_SNAPSHOTS") {
        return PathBuf::from(dir);
    }
    let absolute = std::path::absolute(out).unwrap_or_else(|_| out.to_path_buf());
    let user = std::env::var("USER").unwrap_or_default();
    let name = format!(
        "kiln-{user}-{:016x}",
        fnv1a(absolute.to_string_lossy().as_bytes())
    );
    let shm = Path::new("/dev/shm");
    match shm.is_dir() {
        true => shm.join(name),
        false => std::env::temp_dir().join(name),
    }
}

/// The run's newest complete snapshot: the disk's (`snapshots/` of the run directory) or, with
/// `output.memory_snapshot_every`, the memory's when it is of a later step.
///
/// # Errors
/// A `latest` pointer naming a snapshot that does not exist.
pub fn newest_snapshot(recipe: &Recipe) -> Result<Option<PathBuf>> {
    let out = &recipe.output.dir;
    let disk = snapshot::latest(&out.join("snapshots"))?;
    let memory = match recipe.output.memory_snapshot_every > 0 {
        true => snapshot::latest(&root(out))?,
        false => None,
    };
    let step = |d: &PathBuf| {
        d.file_name()
            .and_then(|n| n.to_str()?.strip_prefix("step-")?.parse::<usize>().ok())
    };
    Ok(match (disk, memory) {
        (Some(d), Some(m)) if step(&m) > step(&d) => Some(m),
        (Some(d), _) => Some(d),
        (None, m) => m,
    })
}
