//! Per-group traffic counters, by collective kind.
//!
//! They count payload bytes this rank put on (and took off) the transport, so they measure
//! what an algorithm really moves: a ring all-reduce of `L` bytes over `N` ranks sends
//! `2 (N-1)/N L` bytes per rank. ZeRO's communication volume is verified with them.

use crate::error::OpKind;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
struct KindCounters {
    calls: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
}

/// Live counters of one group; read them with [`Counters::snapshot`].
#[derive(Debug, Default)]
pub struct Counters {
    kinds: [KindCounters; OpKind::ALL.len()],
}

impl Counters {
    pub(crate) fn call(&self, kind: OpKind) {
        self.kinds[kind.code() as usize]
            .calls
            .fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn sent(&self, kind: OpKind, bytes: usize) {
        self.kinds[kind.code() as usize]
            .bytes_sent
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn received(&self, kind: OpKind, bytes: usize) {
        self.kinds[kind.code() as usize]
            .bytes_received
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// A consistent-enough copy of the counters (each counter is read atomically).
    pub fn snapshot(&self) -> CommStats {
        let mut stats = CommStats::default();
        for kind in OpKind::ALL {
            let c = &self.kinds[kind.code() as usize];
            stats.kinds[kind.code() as usize] = KindStats {
                calls: c.calls.load(Ordering::Relaxed),
                bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
                bytes_received: c.bytes_received.load(Ordering::Relaxed),
            };
        }
        stats
    }
}

/// Counts of one collective kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct KindStats {
    /// Calls made on this rank.
    pub calls: u64,
    /// Payload bytes this rank sent.
    pub bytes_sent: u64,
    /// Payload bytes this rank received.
    pub bytes_received: u64,
}

/// A snapshot of a group's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CommStats {
    kinds: [KindStats; OpKind::ALL.len()],
}

impl CommStats {
    /// The counts of one kind.
    pub fn get(&self, kind: OpKind) -> KindStats {
        self.kinds[kind.code() as usize]
    }
    /// Bytes sent over all kinds.
    pub fn total_sent(&self) -> u64 {
        self.kinds.iter().map(|k| k.bytes_sent).sum()
    }
    /// Bytes received over all kinds.
    pub fn total_received(&self) -> u64 {
        self.kinds.iter().map(|k| k.bytes_received).sum()
    }
    /// The traffic of two groups together (e.g. a hybrid layout's shard and replicate groups).
    pub fn plus(&self, other: &CommStats) -> CommStats {
        self.combine(other, |a, b| a + b)
    }
    /// The traffic between an earlier snapshot and this one.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        self.combine(earlier, |a, b| a - b)
    }
    /// Every counter of `self` and `other`, kind by kind, through `op`.
    fn combine(&self, other: &CommStats, op: impl Fn(u64, u64) -> u64) -> CommStats {
        let mut out = CommStats::default();
        for ((o, a), b) in out.kinds.iter_mut().zip(&self.kinds).zip(&other.kinds) {
            *o = KindStats {
                calls: op(a.calls, b.calls),
                bytes_sent: op(a.bytes_sent, b.bytes_sent),
                bytes_received: op(a.bytes_received, b.bytes_received),
            };
        }
        out
    }
}
