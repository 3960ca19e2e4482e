//! `kiln launch`'s flags.

use std::path::PathBuf;

/// What `kiln launch` was asked to do.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Nodes in the job: N, or MIN:MAX for an elastic job (a node that does not come back
    /// within --rdzv-timeout after a failure is left out, while MIN remain).
    #[arg(long, default_value = "1", value_parser = parse_nnodes)]
    pub nnodes: NodeCount,
    /// This node's index (0 hosts rank 0 and the rendezvous store).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, reachable from every node.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous store on node 0 (0: pick a free one; single node only).
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Seconds the other ranks get to exit after one fails, before they are killed.
    #[arg(long, default_value_t = 5.0)]
    pub grace: f64,
    /// Compute threads per rank (Burn's CPU kernels: RAYON_NUM_THREADS, and OMP_NUM_THREADS).
    /// Default: this node's cores divided among its ranks (at least 1), so that ranks do not
    /// oversubscribe the cores; a RAYON_NUM_THREADS already set is kept.
    #[arg(long)]
    pub threads_per_rank: Option<usize>,
    /// Restart the job this many times after a failure (a rank that exits with an error or
    /// is killed, or hangs: --hang-timeout), from its latest snapshot: the ranks see
    /// KILN_RESTART_COUNT, and `kiln train` then resumes (from step 0 when there is no
    /// snapshot yet).
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// Seconds before the first restart; doubled for each restart in a row whose job made no
    /// step (at most 60).
    #[arg(long, default_value_t = 1.0)]
    pub restart_backoff: f64,
    /// Seconds without progress (no step, no message received) after which a rank that is not
    /// waiting on its peers, or that stopped running (SIGSTOP), is named and the job restarted
    /// as after a failure. 0: off.
    #[arg(long, default_value_t = 0.0)]
    pub hang_timeout: f64,
    /// With restarts: seconds the launchers wait for each other's nodes at each (re)start; an
    /// elastic job goes on without the nodes that have not come by then.
    #[arg(long, default_value_t = 60.0)]
    pub rdzv_timeout: f64,
    /// With restarts: write the recovery summary (restarts, steps recomputed, times to
    /// recover) to this file as JSON.
    #[arg(long)]
    pub summary: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `--nnodes`: a fixed count, or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeCount {
    /// The fewest nodes the job runs on.
    pub min: usize,
    /// The most (node ranks are 0..max).
    pub max: usize,
}

impl NodeCount {
    /// Whether the job may run on fewer nodes than it has.
    pub fn elastic(&self) -> bool {
        self.min < self.max
    }
}

fn parse_nnodes(s: &str) -> std::result::Result<NodeCount, String> {
    let count = |t: &str| {
        t.trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("'{t}' is not a node count (a whole number, at least 1)"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (count(a)?, count(b)?),
        None => (count(s)?, count(s)?),
    };
    if min > max {
        return Err(format!("MIN:MAX with MIN ({min}) above MAX ({max})"));
    }
    Ok(NodeCount { min, max })
}
