//! A rank's compute threads, and the heap a training process keeps.
//!
//! Burn's CPU kernels (Flex's, gemm's) and kiln's own run on Rayon. Ranks as processes each
//! have a pool (`kiln launch` sizes it: `RAYON_NUM_THREADS`, the cores shared among the ranks).
//! A rank that calls Rayon from outside a pool (the main thread, a thread of `spawn_ranks`)
//! hands every kernel to the global pool's workers and sleeps until they finish, on top of
//! them; ranks as threads of one process all feed that one pool, a rank's small kernels
//! queueing behind another's large ones. So a rank runs *inside* a pool of its own, as one of
//! its threads, sized as `kiln launch` sizes a process's: the default recipe went from 37k to
//! 45k tokens/s on one rank, and from 47k to 62k with two thread ranks (DDP), on 2 cores.

use crate::core::error::ShardError;
use std::num::NonZeroUsize;

/// Compute threads for each of `ranks` rank threads of this process: the process's threads
/// (`RAYON_NUM_THREADS` when set, as Rayon reads it, else the available cores) divided among
/// the ranks, at least 1.
///
/// # Errors
/// `RAYON_NUM_THREADS` set to something other than a positive number.
pub fn per_rank(ranks: usize) -> Result<usize, ShardError> {
    let env = std::env::var("RAYON_NUM_THREADS").ok();
    let total = match rayon_threads(env.as_deref())? {
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
    };
    Ok((total / ranks.max(1)).max(1))
}

/// The threads a `RAYON_NUM_THREADS` value asks for: `None` when unset or blank.
///
/// # Errors
/// Anything other than a positive number.
pub fn rayon_threads(value: Option<&str>) -> Result<Option<usize>, ShardError> {
    let Some(v) = value.filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    match v.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(ShardError::Threads(format!(
            "RAYON_NUM_THREADS={v:?} is not a positive number of threads"
        ))),
    }
}

/// Runs `f` with its Rayon work on a pool of `threads` threads of its own: `f` itself runs on
/// one of the pool's threads (this thread waits), and every parallel kernel it starts stays
/// in the pool.
///
/// # Panics
/// If the pool's threads cannot be started; a panic of `f` is resumed here.
pub fn with_own_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("kiln-compute-{i}"))
        // A main thread's stack: `f` is a whole rank (autodiff's backward recurses).
        .stack_size(8 << 20)
        .build()
        .expect("starting a rank's compute threads")
        .install(f)
}

/// [`kiln_comm::spawn_ranks`] for ranks that compute: each rank thread's kernels on a pool of
/// its own of [`per_rank`] threads.
///
/// # Errors
/// As [`per_rank`].
///
/// # Panics
/// As [`kiln_comm::spawn_ranks`].
pub fn spawn_ranks<R, F>(ranks: usize, f: F) -> Result<Vec<R>, ShardError>
where
    R: Send,
    F: Fn(kiln_comm::LocalGroup) -> R + Sync,
{
    let threads = per_rank(ranks)?;
    Ok(kiln_comm::spawn_ranks(ranks, |g| {
        with_own_pool(threads, || f(g))
    }))
}

/// glibc's malloc serves blocks above a (dynamic) threshold, 128 KiB at first, with fresh
/// `mmap`s and gives them back on free: every activation, gradient and matmul output of a
/// training step then costs page faults and zeroing on the next step. Keeping freed memory in
/// the heap instead (as PyTorch's caching allocators do) made the default recipe 15-20% faster
/// on one rank here; the cost is that the process keeps its peak heap until it exits.
/// `KILN_MALLOC=default` keeps glibc's behaviour. Call it at a program's start, before any
/// thread starts (the `kiln` binary and kiln's benchmarks do); off Linux with glibc it does
/// nothing.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var("KILN_MALLOC").as_deref() != Ok("default") {
        // SAFETY: mallopt only sets allocator parameters; called before any thread starts.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_started_inside_stay_in_the_pool() {
        let inside = with_own_pool(3, rayon::current_num_threads);
        assert_eq!(inside, 3);
        let sum: u64 = with_own_pool(2, || {
            use rayon::prelude::*;
            (0..1000u64).into_par_iter().sum()
        });
        assert_eq!(sum, 499_500);
    }

    #[test]
    fn the_process_threads_are_shared_among_the_ranks() {
        // Whatever RAYON_NUM_THREADS the test run has, the process's threads are the total.
        let total = rayon_threads(std::env::var("RAYON_NUM_THREADS").ok().as_deref())
            .unwrap()
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get));
        assert_eq!(per_rank(1).unwrap(), total);
        assert_eq!(per_rank(2).unwrap(), (total / 2).max(1));
        assert_eq!(per_rank(total * 4).unwrap(), 1);
    }

    #[test]
    fn rayon_num_threads_is_a_positive_number_or_unset() {
        assert_eq!(rayon_threads(None).unwrap(), None);
        assert_eq!(rayon_threads(Some("  ")).unwrap(), None);
        assert_eq!(rayon_threads(Some(" 3 ")).unwrap(), Some(3));
        for bad in ["0", "many", "-2"] {
            let e = rayon_threads(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("RAYON_NUM_THREADS"), "{e}");
        }
    }
}
