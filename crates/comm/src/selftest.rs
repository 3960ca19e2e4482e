//! A conformance check of a [`ProcessGroup`]: every collective, element type and reduce
//! operation, on lengths that do and do not divide by the world size, checked against values
//! computed independently on each rank.
//!
//! The same check runs on [`LocalGroup`](crate::LocalGroup) in the tests and on real processes
//! with `kiln launch --nproc-per-node N -- kiln comm-check` (a cluster's first smoke test).
//! Contributions are small integers, so sums are exact in every type and results can be
//! compared exactly.

use crate::dtype::{Element, ReduceOp};
use crate::group::ProcessGroup;
use crate::shard::shard_range;
use half::{bf16, f16};

/// What a passing run checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// Individual collective calls whose result was verified.
    pub checks: usize,
}

/// Rank `rank`'s contribution at index `i`: small integers in -5..=5.
fn value(rank: usize, i: usize) -> f64 {
    ((rank * 7 + i * 3) % 11) as f64 - 5.0
}

fn contribution<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| T::from_f64(value(rank, i))).collect()
}

fn reduced<T: Element>(world: usize, len: usize, op: ReduceOp) -> Vec<T> {
    (0..len)
        .map(|i| {
            let vals = (0..world).map(|r| value(r, i));
            match op {
                ReduceOp::Sum => T::from_f64(vals.sum()),
                ReduceOp::Avg => T::from_f64(vals.sum()).div(world),
                ReduceOp::Max => T::from_f64(vals.fold(f64::MIN, f64::max)),
                ReduceOp::Min => T::from_f64(vals.fold(f64::MAX, f64::min)),
            }
        })
        .collect()
}

fn compare<T: Element>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} is {:?}, expected {:?}",
            got[i], want[i]
        )),
    }
}

fn lengths(world: usize) -> Vec<usize> {
    let mut v = vec![
        0,
        1,
        world.saturating_sub(1),
        world,
        world + 1,
        7,
        1000,
        4099,
        70_001,
    ];
    v.dedup();
    v
}

fn check_type<T: Element>(g: &dyn ProcessGroup, report: &mut Report) -> Result<(), String>
where
    for<'a> &'a mut [T]: Into<crate::BufMut<'a>>,
    for<'a> &'a [T]: Into<crate::BufRef<'a>>,
{
    let (n, r) = (g.world_size(), g.rank());
    let err = |e: crate::CommError| e.to_string();
    for len in lengths(n) {
        let tag = |op: &str| format!("{op}({}, {len} elements)", T::DTYPE);
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut buf = contribution::<T>(r, len);
            g.all_reduce(buf.as_mut_slice().into(), op).map_err(err)?;
            compare(
                &tag(&format!("all_reduce[{op}]")),
                &buf,
                &reduced::<T>(n, len, op),
            )?;

            let input = contribution::<T>(r, len);
            let mine = shard_range(len, n, r);
            let mut out = vec![T::from_f64(99.0); mine.len()];
            g.reduce_scatter(input.as_slice().into(), out.as_mut_slice().into(), op)
                .map_err(err)?;
            compare(
                &tag(&format!("reduce_scatter[{op}]")),
                &out,
                &reduced::<T>(n, len, op)[mine],
            )?;
            report.checks += 2;
        }

        let whole = contribution::<T>(n + 3, len);
        let mine = shard_range(len, n, r);
        let mut out = vec![T::from_f64(99.0); len];
        g.all_gather(whole[mine].into(), out.as_mut_slice().into())
            .map_err(err)?;
        compare(&tag("all_gather"), &out, &whole)?;

        let root = len % n;
        let mut buf = if r == root {
            contribution::<T>(root, len)
        } else {
            vec![T::from_f64(99.0); len]
        };
        g.broadcast(buf.as_mut_slice().into(), root).map_err(err)?;
        compare(
            &tag(&format!("broadcast[root {root}]")),
            &buf,
            &contribution::<T>(root, len),
        )?;

        // A ring of point-to-point messages (a rank sends to itself when alone).
        let send = contribution::<T>(r, len);
        g.send(send.as_slice().into(), (r + 1) % n).map_err(err)?;
        let mut got = vec![T::from_f64(99.0); len];
        let left = (r + n - 1) % n;
        g.recv(got.as_mut_slice().into(), left).map_err(err)?;
        compare(&tag("send/recv"), &got, &contribution::<T>(left, len))?;
        report.checks += 3;
    }
    Ok(())
}

/// Runs the whole check on `group`; every rank of the group must call it.
///
/// # Errors
/// The first wrong result or communication error, as text.
pub fn run(group: &dyn ProcessGroup) -> Result<Report, String> {
    let mut report = Report::default();
    group.barrier().map_err(|e| e.to_string())?;
    check_type::<f32>(group, &mut report)?;
    check_type::<f16>(group, &mut report)?;
    check_type::<bf16>(group, &mut report)?;
    check_type::<i64>(group, &mut report)?;

    // Sub-groups: even and odd ranks reduce separately.
    let (n, r) = (group.world_size(), group.rank());
    let members: Vec<usize> = (0..n).filter(|p| p % 2 == r % 2).collect();
    let sub = group.split(&members, "parity").map_err(|e| e.to_string())?;
    let mut v = vec![r as i64; 5];
    sub.all_reduce((&mut v[..]).into(), ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let want: i64 = members.iter().map(|&p| p as i64).sum();
    compare("sub-group all_reduce", &v, &[want; 5])?;
    group.barrier().map_err(|e| e.to_string())?;
    report.checks += 1;
    Ok(report)
}
