//! Where a rank learns who it is: torchrun-style variables, or SLURM's, or Open MPI's.

use crate::error::{CommError, Result};
use crate::store::{StoreClient, StoreServer};
use std::sync::Arc;

/// Which launcher's variables configured this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnvSource {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
    /// (torchrun, `kiln launch`).
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`, nodelist.
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`.
    OpenMpi,
}

/// This process's place in a multi-process job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank on this node (the GPU ordinal, for NCCL).
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
    /// Which variables these came from.
    pub source: EnvSource,
    /// The job's secret (`KILN_JOB_TOKEN`, which `kiln launch` sets): the rendezvous store and
    /// the peers refuse connections that do not present it. `None` admits any.
    pub job_token: Option<String>,
    /// Where rank 0's store listens (`KILN_STORE_BIND`, e.g. `0.0.0.0` for every interface);
    /// by default on `MASTER_ADDR`'s address only.
    pub store_bind: Option<String>,
}

/// The rendezvous port when a launcher gives none (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

impl LaunchEnv {
    /// Whether this process was started by a launcher as one rank of a job: `RANK` or
    /// `WORLD_SIZE` set (`kiln launch`, torchrun), a SLURM job step (`srun`: `SLURM_PROCID`
    /// with `SLURM_STEP_ID`), or Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`).
    ///
    /// A SLURM batch script also has `SLURM_PROCID` (0) and the allocation's `SLURM_NTASKS`,
    /// but no step: a program run there directly is one process, not rank 0 of a job whose
    /// other ranks would never come.
    pub fn launched() -> bool {
        Self::launched_by(|k| std::env::var(k).ok())
    }

    /// [`launched`](Self::launched) through `get`.
    pub fn launched_by(get: impl Fn(&str) -> Option<String>) -> bool {
        let set = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty());
        set("RANK")
            || set("WORLD_SIZE")
            || (set("SLURM_PROCID") && (set("SLURM_STEP_ID") || set("SLURM_STEPID")))
            || set("OMPI_COMM_WORLD_RANK")
    }

    /// Reads the process environment.
    ///
    /// # Errors
    /// [`CommError::Config`] naming the missing or malformed variables.
    pub fn from_env() -> Result<LaunchEnv> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads variables through `get` (for tests and embedding).
    ///
    /// # Errors
    /// [`CommError::Config`] naming the missing or malformed variables.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let env = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            Self::torchrun(&get)?
        } else if get("SLURM_PROCID").is_some() {
            Self::slurm(&get)?
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            Self::open_mpi(&get)?
        } else {
            return Err(CommError::Config(
                "no launcher variables found: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT \
                 (or run under `kiln launch`, torchrun, SLURM's srun or Open MPI's mpirun)"
                    .into(),
            ));
        };
        LaunchEnv {
            job_token: get("KILN_JOB_TOKEN"),
            store_bind: get("KILN_STORE_BIND"),
            ..env
        }
        .validate()
    }

    fn torchrun(get: &impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let missing: Vec<&str> = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
            .into_iter()
            .filter(|k| get(k).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(CommError::Config(format!(
                "torchrun-style launch is missing {}",
                missing.join(", ")
            )));
        }
        let rank = number(get, "RANK")?;
        let world_size = number(get, "WORLD_SIZE")?;
        // Without LOCAL_* the job is taken to be on one node.
        let local_rank = optional_number(get, "LOCAL_RANK")?.unwrap_or(rank);
        let local_world_size = optional_number(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: get("MASTER_ADDR").expect("checked above"),
            master_port: port(get, "MASTER_PORT")?.expect("checked above"),
            source: EnvSource::Torchrun,
            job_token: None,
            store_bind: None,
        })
    }

    fn slurm(get: &impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let rank = number(get, "SLURM_PROCID")?;
        // Inside a job step (srun), the step's counts: a step may use part of the allocation.
        let world_size = match get("SLURM_STEP_NUM_TASKS") {
            Some(_) => number(get, "SLURM_STEP_NUM_TASKS")?,
            None => number(get, "SLURM_NTASKS")?,
        };
        let local_rank = number(get, "SLURM_LOCALID")?;
        let per_node = get("SLURM_STEP_TASKS_PER_NODE").or_else(|| get("SLURM_NTASKS_PER_NODE"));
        let local_world_size = match per_node {
            // "4" or "4(x2)" or "4(x2),3": the first node's count is ours when uniform.
            Some(v) => v
                .split([',', '('])
                .next()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(|| {
                    CommError::Config(format!("SLURM_NTASKS_PER_NODE={v:?} is not a count"))
                })?,
            None => world_size,
        };
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None => {
                let list = get("SLURM_STEP_NODELIST")
                    .or_else(|| get("SLURM_JOB_NODELIST"))
                    .or_else(|| get("SLURM_NODELIST"))
                    .ok_or_else(|| {
                        CommError::Config(
                            "SLURM launch: set MASTER_ADDR or SLURM_JOB_NODELIST".into(),
                        )
                    })?;
                first_host(&list).ok_or_else(|| {
                    CommError::Config(format!("cannot read a host from nodelist {list:?}"))
                })?
            }
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port: port(get, "MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT),
            source: EnvSource::Slurm,
            job_token: None,
            store_bind: None,
        })
    }

    fn open_mpi(get: &impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let rank = number(get, "OMPI_COMM_WORLD_RANK")?;
        let world_size = number(get, "OMPI_COMM_WORLD_SIZE")?;
        let local_rank = optional_number(get, "OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(rank);
        let local_world_size =
            optional_number(get, "OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world_size);
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            // All ranks on this node: rank 0 is local.
            None if local_world_size == world_size => "127.0.0.1".to_string(),
            // Unknown: the mpi backend needs no store; `rendezvous` says what to set.
            None => String::new(),
        };
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port: port(get, "MASTER_PORT")?.unwrap_or(DEFAULT_MASTER_PORT),
            source: EnvSource::OpenMpi,
            job_token: None,
            store_bind: None,
        })
    }

    fn validate(self) -> Result<LaunchEnv> {
        if self.world_size == 0 {
            return Err(CommError::Config("world size is 0".into()));
        }
        if self.rank >= self.world_size {
            return Err(CommError::Config(format!(
                "rank {} is out of range for world size {} (ranks are 0..{})",
                self.rank, self.world_size, self.world_size
            )));
        }
        if self.local_rank >= self.local_world_size {
            return Err(CommError::Config(format!(
                "local rank {} is out of range for {} ranks on this node",
                self.local_rank, self.local_world_size
            )));
        }
        if self.local_world_size > self.world_size {
            return Err(CommError::Config(format!(
                "{} ranks on this node but only {} in the job",
                self.local_world_size, self.world_size
            )));
        }
        Ok(self)
    }

    /// The job's rendezvous: rank 0 hosts the store (on `KILN_STORE_BIND`, else on
    /// `MASTER_ADDR`'s address only), and every rank connects to it, presenting the job token.
    ///
    /// # Errors
    /// An address that does not resolve or is not this host's, a port in use, a store that
    /// does not answer or refuses the token. A loopback `MASTER_ADDR` for a job on several
    /// nodes is warned about (right only when every node is this host).
    pub fn rendezvous(
        &self,
        timeout: std::time::Duration,
    ) -> Result<(Option<Arc<StoreServer>>, Arc<StoreClient>)> {
        if self.master_addr.is_empty() {
            return Err(CommError::Config(format!(
                "{:?} launch over several nodes ({} ranks, {} on this node) without \
                 MASTER_ADDR: set it to rank 0's host (mpirun -x MASTER_ADDR=...), or use the \
                 mpi backend, which needs no rendezvous",
                self.source, self.world_size, self.local_world_size
            )));
        }
        let server = if self.rank == 0 {
            let bind = self.store_bind_addr()?;
            let token = self.job_token.clone();
            Some(Arc::new(StoreServer::bind_with_token(bind, token)?))
        } else {
            None
        };
        let client = StoreClient::connect_with_token(
            &self.store_addr(),
            timeout,
            self.job_token.as_deref(),
        )?;
        Ok((server, Arc::new(client)))
    }

    /// Where rank 0's store listens.
    fn store_bind_addr(&self) -> Result<std::net::SocketAddr> {
        use std::net::ToSocketAddrs;
        let (host, what) = match &self.store_bind {
            Some(h) => (h.as_str(), "KILN_STORE_BIND"),
            None => (self.master_addr.as_str(), "MASTER_ADDR"),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip = (host, self.master_port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .map(|a| a.ip())
            .ok_or_else(|| CommError::Config(format!("{what}={host:?} does not resolve")))?;
        let nodes = self.world_size.div_ceil(self.local_world_size);
        if self.store_bind.is_none() && ip.is_loopback() && nodes > 1 {
            // Right only when every "node" is this host (a test); said, not refused.
            eprintln!(
                "kiln: MASTER_ADDR={} is {ip}, a loopback address, but the job spans {nodes} \
                 nodes: nodes on other hosts cannot reach rank 0's store. Give MASTER_ADDR as \
                 this host's network address (or KILN_STORE_BIND=0.0.0.0 to listen on every \
                 interface)",
                self.master_addr
            );
        }
        Ok((ip, self.master_port).into())
    }

    /// `host:port` of the rendezvous store.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port) // bare IPv6
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

fn optional_number(get: &impl Fn(&str) -> Option<String>, key: &str) -> Result<Option<usize>> {
    get(key)
        .map(|v| {
            v.trim().parse::<usize>().map_err(|_| {
                CommError::Config(format!("{key}={v:?} is not a non-negative integer"))
            })
        })
        .transpose()
}

fn number(get: &impl Fn(&str) -> Option<String>, key: &str) -> Result<usize> {
    optional_number(get, key)?.ok_or_else(|| CommError::Config(format!("{key} is not set")))
}

fn port(get: &impl Fn(&str) -> Option<String>, key: &str) -> Result<Option<u16>> {
    get(key)
        .map(|v| {
            v.trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| CommError::Config(format!("{key}={v:?} is not a port (1-65535)")))
        })
        .transpose()
}

/// The first host of a SLURM nodelist: `gpu[03-05,9],cpu1` -> `gpu03`.
fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..list[end..].find(']')? + end];
        let first = inner.split([',', '-']).next()?.trim();
        let rest_start = end + inner.len() + 2;
        // A suffix after the bracket ("n[1-2]-ib") belongs to every host.
        let suffix: &str = list[rest_start..].split(',').next().unwrap_or("");
        Some(format!("{prefix}{first}{suffix}"))
    } else if prefix.is_empty() {
        None
    } else {
        Some(prefix.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (3, 8, 1, 2)
        );
        assert_eq!(e.store_addr(), "node0:1234");
        assert_eq!(e.source, EnvSource::Torchrun);
    }

    #[test]
    fn missing_variables_are_named() {
        let err = env(&[("RANK", "0")]).unwrap_err().to_string();
        assert!(
            err.contains("WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
            "{err}"
        );
        let err = env(&[]).unwrap_err().to_string();
        assert!(err.contains("no launcher variables"), "{err}");
    }

    #[test]
    fn inconsistent_numbers_are_named() {
        let base = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        let err = env(&[&base[..], &[("RANK", "4"), ("WORLD_SIZE", "4")]].concat())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 4 is out of range for world size 4"),
            "{err}"
        );
        let err = env(&[&base[..], &[("RANK", "x"), ("WORLD_SIZE", "4")]].concat())
            .unwrap_err()
            .to_string();
        assert!(err.contains("RANK=\"x\""), "{err}");
        let err = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_PORT=\"70000\""), "{err}");
    }

    #[test]
    fn slurm_variables_and_nodelist() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(e.master_addr, "gpu07");
        assert_eq!(e.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn a_launched_rank_is_told_from_a_batch_script() {
        let by = |vars: &[(&str, &str)]| {
            LaunchEnv::launched_by(|k| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        assert!(by(&[("RANK", "0")]));
        assert!(by(&[("OMPI_COMM_WORLD_RANK", "1")]));
        // srun: a job step.
        assert!(by(&[("SLURM_PROCID", "1"), ("SLURM_STEP_ID", "0")]));
        // The batch script itself: one process, whatever the allocation's task count.
        assert!(!by(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")]));
        assert!(!by(&[("RANK", " ")]));
        assert!(!by(&[]));
        // A step's own counts win over the allocation's.
        let e = env(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "8(x2)"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_STEP_NODELIST", "cpu[2-3]"),
            ("SLURM_JOB_NODELIST", "cpu[1-3]"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (2, 4, 0, 2)
        );
        assert_eq!(e.master_addr, "cpu2");
    }

    #[test]
    fn nodelists() {
        assert_eq!(first_host("n1,n2").as_deref(), Some("n1"));
        assert_eq!(first_host("gpu[003-005,9],cpu1").as_deref(), Some("gpu003"));
        assert_eq!(first_host("a[1-2]-ib").as_deref(), Some("a1-ib"));
        assert_eq!(first_host("").as_deref(), None);
    }

    #[test]
    fn open_mpi_variables() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(e.master_addr, "127.0.0.1");
        // Several nodes without MASTER_ADDR: fine for the mpi backend, which needs no store;
        // the rendezvous of the others says what to set.
        let several = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        let err = several
            .rendezvous(std::time::Duration::from_secs(1))
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("set it to rank 0's host"), "{err}");
        assert!(err.contains("mpi backend"), "{err}");
    }

    #[test]
    fn the_store_listens_where_told_and_takes_the_job_token() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
        let job = [
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("KILN_JOB_TOKEN", "tok"),
        ];
        let e = env(&job).unwrap();
        assert_eq!(e.job_token.as_deref(), Some("tok"));
        // The store listens on MASTER_ADDR's address only, and asks for the token.
        let (server, client) = e.rendezvous(std::time::Duration::from_secs(5)).unwrap();
        let server = server.unwrap();
        assert!(server.local_addr().ip().is_loopback());
        assert_eq!(client.token(), Some("tok"));
        let stranger = crate::store::StoreClient::connect(
            &server.local_addr().to_string(),
            std::time::Duration::from_secs(5),
        );
        assert!(stranger.is_err());
    }
}
