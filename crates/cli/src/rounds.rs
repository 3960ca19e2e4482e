//! The launchers' rendezvous (`kiln launch --max-restarts`, elastic `--nnodes`): node 0's
//! launcher hosts a store for the whole job, and each start of the job is a round whose plan
//! node 0 publishes (see `crate::recovery`).

use crate::launch_args::LaunchArgs;
use anyhow::{Context, Result};
use kiln_comm::store::{StoreClient, StoreServer};
use std::time::{Duration, Instant};

/// The launchers' rendezvous (see the module doc): node 0 hosts it, every node talks to it.
/// A lost connection is opened again on the next call.
pub(crate) struct Agent {
    _server: Option<StoreServer>,
    addr: String,
    token: Option<String>,
    client: Option<StoreClient>,
}

const PREFIX: &str = "kiln/launch/";

impl Agent {
    pub(crate) fn start(args: &LaunchArgs, token: Option<String>) -> Result<Agent> {
        let server = if args.node_rank == 0 {
            let host = std::env::var("KILN_STORE_BIND")
                .ok()
                .filter(|h| !h.trim().is_empty())
                .unwrap_or_else(|| args.master_addr.clone());
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = args.master_port;
            let server = StoreServer::bind_with_token((host.as_str(), port), token.clone())
                .with_context(|| format!("hosting the launchers' rendezvous on {host}:{port}"))?;
            Some(server)
        } else {
            None
        };
        let port = server
            .as_ref()
            .map_or(args.master_port, |s| s.local_addr().port());
        let addr = format!("{}:{port}", args.master_addr);
        let mut agent = Agent {
            _server: server,
            addr,
            token,
            client: None,
        };
        agent.connect(Duration::from_secs_f64(args.rdzv_timeout.max(1.0)))?;
        Ok(agent)
    }

    fn connect(&mut self, timeout: Duration) -> Result<&StoreClient> {
        if self.client.is_none() {
            let c = StoreClient::connect_with_token(&self.addr, timeout, self.token.as_deref())
                .with_context(|| format!("reaching the launchers' rendezvous at {}", self.addr))?;
            self.client = Some(c);
        }
        Ok(self.client.as_ref().expect("connected"))
    }

    /// One request, the connection opened again if it was lost (within `patience`).
    fn call<T>(
        &mut self,
        patience: Duration,
        f: impl Fn(&StoreClient) -> kiln_comm::Result<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + patience;
        loop {
            let result = self
                .connect(Duration::from_secs(2))
                .and_then(|c| f(c).map_err(anyhow::Error::from));
            match result {
                Ok(v) => return Ok(v),
                Err(e) => {
                    self.client = None;
                    if Instant::now() >= deadline {
                        return Err(e.context(format!(
                            "lost the launchers' rendezvous at {} for {:.0}s (node 0's \
                             launcher gone, or this node cut off)",
                            self.addr,
                            patience.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    pub(crate) fn check(&mut self, key: &str, patience: Duration) -> Result<bool> {
        let key = format!("{PREFIX}{key}");
        self.call(patience, |c| c.check(&key))
    }

    pub(crate) fn get_now(&mut self, key: &str, patience: Duration) -> Result<Option<String>> {
        let key = format!("{PREFIX}{key}");
        self.call(patience, |c| {
            Ok(if c.check(&key)? {
                Some(String::from_utf8_lossy(&c.get(&key)?).into_owned())
            } else {
                None
            })
        })
    }

    pub(crate) fn set(&mut self, key: &str, value: &str, patience: Duration) -> Result<()> {
        let key = format!("{PREFIX}{key}");
        self.call(patience, |c| c.set(&key, value.as_bytes()))
    }
}

/// A round's plan: the nodes taking part (node rank, ranks on it), the ranks' store port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) port: u16,
    pub(crate) nodes: Vec<(usize, usize)>,
}

impl Plan {
    fn encode(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(|(n, p)| format!("{n}:{p}")).collect();
        format!("{} {}", self.port, nodes.join(","))
    }

    fn decode(s: &str) -> Option<Plan> {
        let (port, nodes) = s.split_once(' ')?;
        let nodes = nodes
            .split(',')
            .map(|np| {
                let (n, p) = np.split_once(':')?;
                Some((n.parse().ok()?, p.parse().ok()?))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Plan {
            port: port.parse().ok()?,
            nodes,
        })
    }

    /// This node's first global rank, the world size and this node's index, if it takes part.
    pub(crate) fn place(&self, node: usize) -> Option<(usize, usize, usize)> {
        let world = self.nodes.iter().map(|(_, p)| p).sum();
        let i = self.nodes.iter().position(|(n, _)| *n == node)?;
        let first = self.nodes[..i].iter().map(|(_, p)| p).sum();
        Some((first, world, i))
    }
}

/// What waiting for a round's plan came to.
pub(crate) enum Next {
    Plan(Plan),
    /// The job ended (`done`, or why it was given up).
    End(String),
}

/// Whether the launcher was sent a signal (then: stop).
pub(crate) fn signalled() -> Option<i32> {
    crate::round::take_signal()
}

/// Node 0: waits for the nodes of round `r`, then publishes its plan.
fn coordinate(agent: &mut Agent, args: &LaunchArgs, r: usize) -> Result<Next> {
    let patience = Duration::from_secs(10);
    let wait = Duration::from_secs_f64(args.rdzv_timeout);
    let start = Instant::now();
    let present = loop {
        let mut present = Vec::new();
        for n in 0..args.nnodes.max {
            if let Some(p) = agent.get_now(&format!("round/{r}/node/{n}"), patience)? {
                present.push((n, p.parse::<usize>().context("a node's rank count")?));
            }
        }
        if present.len() == args.nnodes.max {
            break present;
        }
        if start.elapsed() >= wait {
            if present.len() >= args.nnodes.min {
                let missing: Vec<usize> = (0..args.nnodes.max)
                    .filter(|n| !present.iter().any(|(p, _)| p == n))
                    .collect();
                eprintln!(
                    "[kiln launch] node(s) {missing:?} did not come within {:.0}s: the job goes \
                     on with {} node(s) ({} at least); they are admitted at a later restart",
                    wait.as_secs_f64(),
                    present.len(),
                    args.nnodes.min
                );
                break present;
            }
            let why = format!(
                "only {} of the {} nodes needed came to the rendezvous within {:.0}s (nodes \
                 present: {:?})",
                present.len(),
                args.nnodes.min,
                wait.as_secs_f64(),
                present.iter().map(|(n, _)| n).collect::<Vec<_>>()
            );
            agent.set("job/end", &why, patience)?;
            return Ok(Next::End(why));
        }
        if let Some(sig) = signalled() {
            let why = format!("node 0's launcher received signal {sig}");
            agent.set("job/end", &why, patience)?;
            return Ok(Next::End(why));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let port = if args.nnodes.max == 1 && args.master_port == 0 {
        crate::round::free_port()?
    } else {
        args.master_port + 1
    };
    let plan = Plan {
        port,
        nodes: present,
    };
    agent.set(&format!("round/{r}/plan"), &plan.encode(), patience)?;
    agent.set("round/current", &r.to_string(), patience)?;
    Ok(Next::Plan(plan))
}

/// Every node: says it is ready for round `r` and waits for the plan (node 0 makes it).
pub(crate) fn join_round(agent: &mut Agent, args: &LaunchArgs, r: usize) -> Result<Next> {
    let patience = Duration::from_secs_f64(args.rdzv_timeout.max(1.0));
    agent.set(
        &format!("round/{r}/node/{}", args.node_rank),
        &args.nproc_per_node.to_string(),
        patience,
    )?;
    agent.set(&format!("known/{}", args.node_rank), "1", patience)?;
    if args.node_rank == 0 {
        return coordinate(agent, args, r);
    }
    loop {
        if let Some(end) = agent.get_now("job/end", patience)? {
            return Ok(Next::End(end));
        }
        if let Some(p) = agent.get_now(&format!("round/{r}/plan"), patience)? {
            return Plan::decode(&p)
                .map(Next::Plan)
                .with_context(|| format!("a damaged plan for round {r}: {p:?}"));
        }
        if let Some(sig) = signalled() {
            return Ok(Next::End(format!("this launcher received signal {sig}")));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The round a launcher joins first: the one after the job's current round if that one is
/// under way (a node that comes late, or again), else the current one.
pub(crate) fn first_round(agent: &mut Agent, patience: Duration) -> Result<usize> {
    let Some(cur) = agent.get_now("round/current", patience)? else {
        return Ok(0);
    };
    let cur: usize = cur.parse().context("the job's current round")?;
    Ok(if agent.check(&format!("round/{cur}/plan"), patience)? {
        cur + 1
    } else {
        cur
    })
}

/// After this node's ranks all exited 0: waits for the other nodes of the round. `None`: the
/// job is done; `Some(why)`: another node failed the round.
pub(crate) fn finish(
    agent: &mut Agent,
    args: &LaunchArgs,
    plan: &Plan,
    r: usize,
) -> Result<Option<String>> {
    let patience = Duration::from_secs_f64(args.rdzv_timeout.max(1.0));
    let start = Instant::now();
    loop {
        if let Some(why) = agent.get_now(&format!("round/{r}/failed"), patience)? {
            return Ok(Some(why));
        }
        let mut all = true;
        for (n, _) in &plan.nodes {
            all &= agent.check(&format!("round/{r}/ok/{n}"), patience)?;
        }
        if all {
            if args.node_rank == 0 {
                agent.set("job/end", "done", patience)?;
            }
            return Ok(None);
        }
        if agent.get_now("job/end", patience)?.as_deref() == Some("done") {
            return Ok(None);
        }
        if start.elapsed() >= patience {
            // Every rank here succeeded; a node that never says so is not waited for.
            if args.node_rank == 0 {
                agent.set("job/end", "done", patience)?;
            }
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Node 0, before its rendezvous goes: up to 5 s for every node that ever joined to say bye
/// (having read the end).
pub(crate) fn linger(agent: &mut Agent, args: &LaunchArgs) {
    let until = Instant::now() + Duration::from_secs(5);
    let patience = Duration::from_millis(500);
    while Instant::now() < until {
        let waiting = (1..args.nnodes.max).any(|n| {
            agent
                .check(&format!("known/{n}"), patience)
                .unwrap_or(false)
                && !agent.check(&format!("bye/{n}"), patience).unwrap_or(true)
        });
        if !waiting {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_place_each_node() {
        let plan = Plan {
            port: 29501,
            nodes: vec![(0, 2), (2, 4)],
        };
        assert_eq!(Plan::decode(&plan.encode()), Some(plan.clone()));
        assert_eq!(plan.place(0), Some((0, 6, 0)));
        assert_eq!(plan.place(2), Some((2, 6, 1)));
        assert_eq!(plan.place(1), None);
        assert_eq!(Plan::decode("x 0:1"), None);
    }
}
