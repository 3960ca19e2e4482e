//! Every rank writes its pieces of a snapshot into one directory, so `output.dir` must be one
//! directory that every rank sees: on several nodes, a filesystem they all mount. A node-local
//! disk fails at the first snapshot ("cannot create …/rank-00001.tmp") without saying why;
//! this check says it before training starts.

use crate::error::{IoContext, Result, fail};
use kiln_comm::ProcessGroup;
use std::path::Path;

/// Checks that every rank of `group` sees the same directory `dir`: each rank writes a probe
/// file into it and reads everyone's. Every rank must call it; every rank returns the same
/// answer.
///
/// # Errors
/// A directory that some rank cannot create or write, one that not every rank sees (naming
/// what each rank saw), or a failed collective.
pub fn check_shared(dir: &Path, group: &dyn ProcessGroup) -> Result<()> {
    let world = group.world_size();
    let all = probe(dir, group)?;
    if all.iter().any(|&s| s != world as i64) {
        let views: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, s)| format!("rank {r} sees {s} of {world}"))
            .collect();
        fail!(
            Snapshot,
            "output directory {} is not one directory shared by every rank ({} ranks' probe \
             files): every rank writes its part of each snapshot there, so it must be on a \
             filesystem that every node mounts at the same path (NFS, Lustre, ...); pass such a \
             directory to --out",
            dir.display(),
            views.join(", ")
        );
    }
    Ok(())
}

/// Whether every rank of `group` sees the same directory `dir` (as [`check_shared`] checks;
/// a collective, with the same answer on every rank).
///
/// # Errors
/// A directory that some rank cannot create or write, or a failed collective.
pub fn is_shared(dir: &Path, group: &dyn ProcessGroup) -> Result<bool> {
    let world = group.world_size() as i64;
    Ok(probe(dir, group)?.iter().all(|&s| s == world))
}

/// How many ranks' probe files each rank sees in `dir`.
fn probe(dir: &Path, group: &dyn ProcessGroup) -> Result<Vec<i64>> {
    let (rank, world) = (group.rank(), group.world_size());
    // A job simulated by `kiln plan` runs one rank per role; the others write nothing.
    if world == 1 || group.is_simulated() {
        return Ok(vec![world as i64; world]);
    }
    // A nonce from rank 0, so that the probes of an earlier run are never taken for this one's.
    let mut nonce = [if rank == 0 { nonce() } else { 0i64 }];
    group.broadcast((&mut nonce[..]).into(), 0)?;
    let nonce = nonce[0];
    let probe = dir.join(format!(".kiln-probe-{:016x}", nonce as u64));
    let file = |r: usize| probe.join(format!("rank-{r:05}"));
    std::fs::create_dir_all(&probe)
        .and_then(|()| std::fs::write(file(rank), nonce.to_string()))
        .io(|| {
            format!(
                "cannot write a probe file in output directory {}",
                dir.display()
            )
        })?;
    group.barrier()?;
    let seen = (0..world)
        .filter(|&r| std::fs::read_to_string(file(r)).is_ok_and(|s| s == nonce.to_string()))
        .count();
    let mut all = vec![0i64; world];
    group.all_gather((&[seen as i64][..]).into(), (&mut all[..]).into())?;
    // Everyone has read before anyone removes; then the directory goes once it is empty.
    group.barrier()?;
    let _ = std::fs::remove_file(file(rank));
    group.barrier()?;
    let _ = std::fs::remove_dir(&probe);
    Ok(all)
}

fn nonce() -> i64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (t ^ (u64::from(std::process::id()) << 32)) as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_comm::{LocalGroup, spawn_ranks};

    #[test]
    fn a_shared_directory_passes_and_is_left_clean() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let results = spawn_ranks(3, |g: LocalGroup| check_shared(&path, &g).is_ok());
        assert_eq!(results, [true; 3]);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "probe left behind"
        );
    }

    #[test]
    fn directories_that_differ_between_ranks_are_named_on_every_rank() {
        // Each rank its own directory: what node-local disks look like.
        let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
        let paths: Vec<_> = dirs.iter().map(|d| d.path().to_path_buf()).collect();
        let results = spawn_ranks(2, |g: LocalGroup| {
            let rank = g.rank();
            check_shared(&paths[rank], &g).unwrap_err().to_string()
        });
        for e in &results {
            assert!(
                e.contains("is not one directory shared by every rank"),
                "{e}"
            );
            assert!(e.contains("rank 0 sees 1 of 2, rank 1 sees 1 of 2"), "{e}");
            assert!(e.contains("filesystem that every node mounts"), "{e}");
        }
    }
}
