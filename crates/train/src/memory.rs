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
//! its restarts find the same one. With ranks on several machines, each machine also keeps a
//! copy of the machine before's pieces, and a restart first makes the newest step the machines
//! hold between them a disk snapshot ([`save_with_peer`], [`promote`]).

use crate::Recipe;
use crate::error::{IoContext, Result, TrainError, fail};
use crate::snapshot::{self, Meta, Part, write_atomic};
use kiln_comm::hash::fnv1a;
use kiln_comm::{BufMut, BufRef, ProcessGroup};
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
pub(crate) fn newest_snapshot(recipe: &Recipe) -> Result<Option<PathBuf>> {
    let out = &recipe.output.dir;
    let disk = snapshot::latest(&out.join("snapshots"))?;
    let memory = match recipe.output.memory_snapshot_every > 0 {
        true => snapshot::latest(&root(out))?,
        false => None,
    };
    Ok(match (disk, memory) {
        (Some(d), Some(m)) if snapshot::step_of(&m) > snapshot::step_of(&d) => Some(m),
        (Some(d), _) => Some(d),
        (None, m) => m,
    })
}

// ---- ranks on several machines: a copy on the next machine, promoted to disk at a resume ----

/// Where a rank's memory snapshot is copied when the ranks span machines: to rank `to` (the same
/// local rank on the next machine), while this rank keeps rank `from`'s (the machine before).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peers {
    /// The rank that keeps a copy of this rank's pieces.
    pub to: usize,
    /// The rank whose pieces this rank keeps a copy of.
    pub from: usize,
}

/// The peers of `rank` among `world` ranks, `local` on each machine.
pub fn peers(rank: usize, world: usize, local: usize) -> Peers {
    Peers {
        to: (rank + local) % world,
        from: (rank + world - local) % world,
    }
}

/// The largest job whose memory snapshots can be promoted across machines (a bitmap of ranks
/// per machine is exchanged at a resume).
pub const MAX_RANKS: usize = 4096;

/// Writes this rank's pieces of memory snapshot `meta.step` under `root` (this machine's) and
/// keeps the copy of `peers.from`'s pieces there too; `peers.to` keeps a copy of this rank's.
/// Every rank of `group` calls it (the pieces cross machines on the group, before the call
/// returns); the files are written asynchronously like a disk snapshot's ([`snapshot::flush`]).
/// No manifest is written: the newest step whose pieces the machines hold between them is made
/// a disk snapshot at a resume ([`promote`]). The two newest steps are kept.
///
/// # Errors
/// A failed collective; asynchronously, a file that cannot be written.
pub fn save_with_peer(
    root: &Path,
    meta: &Meta,
    parts: Vec<Part>,
    group: &dyn ProcessGroup,
    peers: Peers,
) -> Result<PathBuf> {
    let rank = group.rank();
    snapshot::flush_where(|r, k| r == root && k == rank)?;
    let (file, bytes, index) = snapshot::serialize(rank, parts)?;
    let meta_json = match rank {
        0 => serde_json::to_vec(meta).expect("the meta serialises"),
        _ => Vec::new(),
    };
    let mine = encode(&[file.as_bytes(), &index, &bytes, &meta_json]);
    let mut count = [0i64];
    group.send_recv(
        BufRef::I64(&[mine.len() as i64]),
        peers.to,
        BufMut::I64(&mut count),
        peers.from,
    )?;
    let mut theirs = vec![0i64; count[0] as usize];
    group.send_recv(
        BufRef::I64(&mine),
        peers.to,
        BufMut::I64(&mut theirs),
        peers.from,
    )?;
    let partial = root.join(format!(".{}.partial", snapshot::step_dir(meta.step)));
    let (dir, at) = (partial.clone(), root.to_path_buf());
    let handle = std::thread::Builder::new()
        .name(format!("kiln-memory-snapshot-{rank}"))
        .spawn(move || {
            std::fs::create_dir_all(&dir).io(|| format!("cannot create {}", dir.display()))?;
            for words in [mine, theirs] {
                let [file, index, bytes, meta] = decode::<4>(&words)?;
                let file = String::from_utf8(file)
                    .map_err(|_| TrainError::Snapshot("a peer's file name is not UTF-8".into()))?;
                let Some(stem) = file.strip_suffix(".safetensors") else {
                    fail!(Snapshot, "a peer sent the file {file:?}, not a rank's");
                };
                write_atomic(&dir.join(&file), &bytes)?;
                write_atomic(&dir.join(format!("{stem}.json")), &index)?;
                if !meta.is_empty() {
                    write_atomic(&dir.join(META), &meta)?;
                }
            }
            // The two newest steps stay: the newest may be the one a failure interrupts.
            let mut steps: Vec<(usize, PathBuf)> = partials(&at);
            steps.sort();
            for (_, old) in steps.iter().rev().skip(2) {
                let _ = std::fs::remove_dir_all(old);
            }
            Ok(())
        })
        .io(|| "cannot start the thread that writes the memory snapshot".to_string())?;
    snapshot::pend(root, rank, handle);
    Ok(partial)
}

/// The meta's file in a memory snapshot of ranks on several machines.
const META: &str = "meta.json";

/// The `.step-N.partial` directories under `root`, with their steps.
fn partials(root: &Path) -> Vec<(usize, PathBuf)> {
    snapshot::partial_dirs(root)
        .into_iter()
        .filter_map(|d| {
            let name = d.file_name()?.to_str()?.to_string();
            let step = name
                .strip_prefix(".step-")?
                .strip_suffix(".partial")?
                .parse()
                .ok()?;
            Some((step, d))
        })
        .collect()
}

/// At a resume of ranks on several machines (every rank of the new job calls it): the newest
/// memory snapshot whose pieces the machines hold between them (each its own ranks' and a copy
/// of the machine before's), if it is newer than `disk`'s newest, is written to `disk` as a
/// complete snapshot (each piece by the first rank that holds it; rank 0 writes the manifest).
/// Returns its step.
///
/// # Errors
/// A failed collective; a file that cannot be read or written; a job of more than
/// [`MAX_RANKS`] ranks.
pub fn promote(
    memory: &Path,
    disk: &Path,
    group: &dyn ProcessGroup,
    keep: usize,
) -> Result<Option<usize>> {
    const WORDS: usize = MAX_RANKS / 64;
    const SLOT: usize = 2 + WORDS;
    const CANDIDATES: usize = 2;
    // This machine's two newest steps: [step + 1, world size from the meta (0: no meta here),
    // bitmap of the ranks whose index is here].
    let mut held = partials(memory);
    held.sort();
    let mut mine = vec![0i64; CANDIDATES * SLOT];
    for (c, (step, dir)) in held.iter().rev().take(CANDIDATES).enumerate() {
        let slot = &mut mine[c * SLOT..(c + 1) * SLOT];
        slot[0] = *step as i64 + 1;
        if let Ok(text) = std::fs::read(dir.join(META))
            && let Ok(meta) = serde_json::from_slice::<Meta>(&text)
        {
            if meta.world_size > MAX_RANKS {
                fail!(
                    Snapshot,
                    "memory snapshots across machines hold at most {MAX_RANKS} ranks, this one \
                     {}",
                    meta.world_size
                );
            }
            slot[1] = meta.world_size as i64;
        }
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(q) = name
                .strip_prefix("rank-")
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&q| q < MAX_RANKS)
            {
                slot[2 + q / 64] |= 1i64 << (q % 64);
            }
        }
    }
    let world = group.world_size();
    let mut all = vec![0i64; world * mine.len()];
    group.all_gather(BufRef::I64(&mine), BufMut::I64(&mut all))?;
    // Every machine's holdings as the ranks reported them: (rank, step, world size, bitmap).
    let held: Vec<(usize, usize, usize, &[i64])> = all
        .chunks(mine.len())
        .enumerate()
        .flat_map(|(r, row)| {
            row.chunks(SLOT)
                .filter(|s| s[0] > 0)
                .map(move |s| (r, (s[0] - 1) as usize, s[1] as usize, &s[2..]))
        })
        .collect();
    let holds = |bits: &[i64], q: usize| bits[q / 64] >> (q % 64) & 1 == 1;
    let on_disk = snapshot::latest(disk)?.and_then(|d| snapshot::step_of(&d));
    let mut steps: Vec<usize> = held.iter().map(|h| h.1).collect();
    steps.sort_unstable();
    steps.dedup();
    // The newest step that every old rank's pieces cover, with its meta somewhere.
    let chosen = steps.into_iter().rev().find_map(|step| {
        let entries: Vec<(usize, usize, &[i64])> = held
            .iter()
            .filter(|h| h.1 == step)
            .map(|&(r, _, w, bits)| (r, w, bits))
            .collect();
        let old = entries.iter().map(|(_, w, _)| *w).max()?;
        let covered =
            old > 0 && (0..old).all(|q| entries.iter().any(|(_, _, bits)| holds(bits, q)));
        covered.then_some((step, old, entries))
    });
    let Some((step, old, entries)) = chosen.filter(|(s, _, _)| on_disk.is_none_or(|d| *s > d))
    else {
        return Ok(None);
    };
    let name = snapshot::step_dir(step);
    let (from, partial) = (
        memory.join(format!(".{name}.partial")),
        disk.join(format!(".{name}.partial")),
    );
    let me = group.rank();
    let first_holder = |q: usize| {
        entries
            .iter()
            .filter(|(_, _, bits)| holds(bits, q))
            .map(|(r, _, _)| *r)
            .min()
    };
    let meta_holder = entries
        .iter()
        .filter(|(_, w, _)| *w > 0)
        .map(|(r, _, _)| *r)
        .min();
    let copy = |file: &str| -> Result<()> {
        let bytes = std::fs::read(from.join(file))
            .io(|| format!("cannot read {}", from.join(file).display()))?;
        write_atomic(&partial.join(file), &bytes)
    };
    std::fs::create_dir_all(&partial).io(|| format!("cannot create {}", partial.display()))?;
    for q in (0..old).filter(|&q| first_holder(q) == Some(me)) {
        copy(&format!("rank-{q:05}.safetensors"))?;
        copy(&format!("rank-{q:05}.json"))?;
    }
    if meta_holder == Some(me) {
        copy(META)?;
    }
    group.barrier()?;
    if me == 0 {
        let path = partial.join(META);
        let meta: Meta = serde_json::from_slice(
            &std::fs::read(&path).io(|| format!("cannot read {}", path.display()))?,
        )
        .map_err(|e| TrainError::Snapshot(format!("{}: {e}", path.display())))?;
        let _ = std::fs::remove_file(&path);
        snapshot::SnapshotWrite {
            root: disk.to_path_buf(),
            meta,
            partial: partial.clone(),
            done: disk.join(&name),
            rank: 0,
            world: old,
            keep,
        }
        .complete()?;
    }
    group.barrier()?;
    Ok(Some(step))
}

/// Byte strings as one message of i64 words: the total length, then the lengths, then the
/// bytes, padded.
fn encode(parts: &[&[u8]]) -> Vec<i64> {
    let mut bytes = Vec::new();
    for p in parts {
        bytes.extend((p.len() as u64).to_le_bytes());
    }
    for p in parts {
        bytes.extend_from_slice(p);
    }
    let mut words = vec![bytes.len() as i64];
    words.extend(bytes.chunks(8).map(|c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        i64::from_le_bytes(w)
    }));
    words
}

/// [`encode`]'s `N` byte strings back.
fn decode<const N: usize>(words: &[i64]) -> Result<[Vec<u8>; N]> {
    let bad = || TrainError::Snapshot("a peer's memory snapshot message is damaged".into());
    let (&len, rest) = words.split_first().ok_or_else(bad)?;
    let mut bytes: Vec<u8> = rest.iter().flat_map(|w| w.to_le_bytes()).collect();
    if len < 0 || len as usize > bytes.len() {
        return Err(bad());
    }
    bytes.truncate(len as usize);
    let mut at = 8 * N;
    let lens: Vec<usize> = (0..N)
        .map(|i| {
            let b: [u8; 8] = bytes.get(8 * i..8 * i + 8)?.try_into().ok()?;
            Some(u64::from_le_bytes(b) as usize)
        })
        .collect::<Option<_>>()
        .ok_or_else(bad)?;
    let mut out: [Vec<u8>; N] = std::array::from_fn(|_| Vec::new());
    for (i, l) in lens.into_iter().enumerate() {
        out[i] = bytes.get(at..at + l).ok_or_else(bad)?.to_vec();
        at += l;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_damage_is_named() {
        let parts: [&[u8]; 3] = [b"rank-00001.safetensors", b"", b"0123456789abc"];
        let words = encode(&parts);
        let back = decode::<3>(&words).unwrap();
        assert_eq!(back.iter().map(Vec::as_slice).collect::<Vec<_>>(), parts);
        assert!(decode::<3>(&words[..2]).is_err());
        assert!(decode::<3>(&[]).is_err());
    }

    #[test]
    fn peers_are_on_the_next_and_the_previous_machine() {
        // 3 machines of 2 ranks.
        assert_eq!(peers(0, 6, 2), Peers { to: 2, from: 4 });
        assert_eq!(peers(5, 6, 2), Peers { to: 1, from: 3 });
    }
}
