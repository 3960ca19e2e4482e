//! Joining a launched job by the name of a group implementation (`--backend`,
//! `parallel.backend`): the one place where kiln's commands turn a name into a group.

use crate::env::LaunchEnv;
use crate::error::{CommError, Result};
use crate::group::{GroupOptions, ProcessGroup};
use crate::tcp::TcpGroup;
use std::sync::Arc;

/// The implementations a job can be joined through, and whether this build has each.
pub const BACKENDS: [(&str, bool); 3] = [
    ("tcp", true),
    ("nccl", cfg!(feature = "nccl")),
    ("mpi", cfg!(feature = "mpi")),
];

/// Joins the job `env` describes through the implementation named `backend`: "tcp" (any
/// launcher), "nccl" (one GPU per rank; feature `nccl`) or "mpi" (a job started by `mpirun` or
/// `srun`; feature `mpi`).
///
/// # Errors
/// An unknown name, or one this build lacks (naming the feature to build with); then the
/// implementation's own errors.
pub fn join(
    backend: &str,
    env: &LaunchEnv,
    options: GroupOptions,
) -> Result<Arc<dyn ProcessGroup>> {
    // Under `kiln launch`: the heartbeat its hang detection reads.
    crate::progress::start_from_env();
    match backend {
        "tcp" => Ok(Arc::new(TcpGroup::from_launch_env(env, options)?)),
        #[cfg(feature = "nccl")]
        "nccl" => Ok(Arc::new(crate::NcclGroup::from_launch_env(env, options)?)),
        #[cfg(feature = "mpi")]
        "mpi" => Ok(Arc::new(crate::MpiGroup::from_launch_env(env, options)?)),
        _ => Err(CommError::Config(unavailable(backend))),
    }
}

fn unavailable(backend: &str) -> String {
    match BACKENDS.iter().find(|(name, _)| *name == backend) {
        Some(_) => format!(
            "the {backend} backend is not built in: rebuild kiln with `--features {backend}`"
        ),
        None => format!(
            "unknown backend '{backend}': one of {}",
            BACKENDS.map(|(name, _)| name).join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_missing_backends_are_named() {
        let env = LaunchEnv::from_vars(|k| match k {
            "RANK" => Some("0".into()),
            "WORLD_SIZE" => Some("1".into()),
            "MASTER_ADDR" => Some("127.0.0.1".into()),
            "MASTER_PORT" => Some("1".into()),
            _ => None,
        })
        .unwrap();
        let err = join("gloo", &env, GroupOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown backend 'gloo': one of tcp, nccl, mpi"),
            "{err}"
        );
        if !cfg!(feature = "mpi") {
            let err = join("mpi", &env, GroupOptions::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains("rebuild kiln with `--features mpi`"), "{err}");
        }
    }
}
