//! A conformance check of a [`ProcessGroup`]: every collective, element type and reduce
//! operation, on lengths that do and do not divide by the world size, checked against values
//! computed independently on each rank.
//!
//! The same check runs on [`LocalGroup`](crate::LocalGroup) in the tests and on real processes
//! with `kiln launch --nproc-per-node N -- kiln comm-check` (a cluster's first smoke test).
//! Contributions are small integers, so sums are exact in every type and results can be
//! compared exactly, with one exception: NCCL computes a floating-point `Avg` by pre-scaling
//! each contribution by a rounded 1/N and summing, so there its results are compared within
//! [`avg_tolerance`] (the local and TCP groups sum, then divide once: exact).

use crate::dtype::{DType, Element, ReduceOp};
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
    compare_within(what, got, want, 0.0)
}

/// `compare` allowing `|got - want| <= tolerance` (0: bitwise equal).
fn compare_within<T: Element>(
    what: &str,
    got: &[T],
    want: &[T],
    tolerance: f64,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    let differs = |a: &T, b: &T| {
        if tolerance == 0.0 {
            a != b
        } else {
            // A NaN result fails too.
            let d = (to_f64(*a) - to_f64(*b)).abs();
            d.is_nan() || d > tolerance
        }
    };
    match got.iter().zip(want).position(|(a, b)| differs(a, b)) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} is {:?}, expected {:?}{}",
            got[i],
            want[i],
            if tolerance > 0.0 {
                format!(" (tolerance {tolerance:.3e})")
            } else {
                String::new()
            }
        )),
    }
}

fn to_f64<T: Element>(x: T) -> f64 {
    match T::DTYPE {
        DType::F32 => bytemuck::cast::<T, f32>(x) as f64,
        DType::F16 => bytemuck::cast::<T, f16>(x).to_f64(),
        DType::BF16 => bytemuck::cast::<T, bf16>(x).to_f64(),
        DType::I64 => bytemuck::cast::<T, i64>(x) as f64,
    }
}

/// How far NCCL's `Avg` of `world` contributions in `-5..=5` may be from the exact average
/// rounded to `dtype`. NCCL multiplies each contribution by 1/N rounded to the element type,
/// then sums: N products (each off by at most half an ulp of 5/N), N-1 additions (half an
/// ulp of at most 5 each), the rounded scalar (half an ulp of the result) and the expected
/// value's own rounding sum to at most 2.5 (N + 3) machine epsilons; twice that is allowed,
/// for the reduction order. Integers are summed, then divided (truncating, as here): exact.
pub fn avg_tolerance(dtype: DType, world: usize) -> f64 {
    let eps = match dtype {
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => f16::EPSILON.to_f64(),
        DType::BF16 => bf16::EPSILON.to_f64(),
        DType::I64 => return 0.0,
    };
    5.0 * (world as f64 + 3.0) * eps
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
    // Local and TCP groups divide once, exactly; NCCL pre-scales (see `avg_tolerance`).
    let tolerance = |op: ReduceOp| match (op, g.backend()) {
        (ReduceOp::Avg, "nccl") => avg_tolerance(T::DTYPE, n),
        _ => 0.0,
    };
    for len in lengths(n) {
        let tag = |op: &str| format!("{op}({}, {len} elements)", T::DTYPE);
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut buf = contribution::<T>(r, len);
            g.all_reduce(buf.as_mut_slice().into(), op).map_err(err)?;
            compare_within(
                &tag(&format!("all_reduce[{op}]")),
                &buf,
                &reduced::<T>(n, len, op),
                tolerance(op),
            )?;

            let input = contribution::<T>(r, len);
            let mine = shard_range(len, n, r);
            let mut out = vec![T::from_f64(99.0); mine.len()];
            g.reduce_scatter(input.as_slice().into(), out.as_mut_slice().into(), op)
                .map_err(err)?;
            compare_within(
                &tag(&format!("reduce_scatter[{op}]")),
                &out,
                &reduced::<T>(n, len, op)[mine],
                tolerance(op),
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

        // A ring of point-to-point messages (a rank sends to itself when alone), as one
        // exchange per rank.
        let send = contribution::<T>(r, len);
        let mut got = vec![T::from_f64(99.0); len];
        let left = (r + n - 1) % n;
        g.send_recv(
            send.as_slice().into(),
            (r + 1) % n,
            got.as_mut_slice().into(),
            left,
        )
        .map_err(err)?;
        compare(&tag("send_recv ring"), &got, &contribution::<T>(left, len))?;

        // The same ring as a lone send then a lone recv on every rank: sends must return
        // before they are received (NCCL's own do not; kiln's NCCL group queues them), or
        // every rank waits in its send.
        let mut got = vec![T::from_f64(99.0); len];
        g.send(send.as_slice().into(), (r + 1) % n).map_err(err)?;
        g.recv(got.as_mut_slice().into(), left).map_err(err)?;
        compare(
            &tag("send then recv ring"),
            &got,
            &contribution::<T>(left, len),
        )?;

        // A message to oneself, queued until received.
        let mut got = vec![T::from_f64(99.0); len];
        g.send(send.as_slice().into(), r).map_err(err)?;
        g.recv(got.as_mut_slice().into(), r).map_err(err)?;
        compare(&tag("send/recv to self"), &got, &send)?;
        report.checks += 4;
    }
    Ok(())
}

/// A check that failed: the first wrong result or communication error, described.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CheckFailed(pub String);

/// Runs the whole check on `group`; every rank of the group must call it.
///
/// # Errors
/// The first wrong result or communication error.
pub fn run(group: &dyn ProcessGroup) -> Result<Report, CheckFailed> {
    run_checks(group).map_err(CheckFailed)
}

fn run_checks(group: &dyn ProcessGroup) -> Result<Report, String> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalGroup, spawn_ranks};

    #[test]
    fn avg_tolerance_is_a_few_ulps_of_the_type_and_zero_for_integers() {
        assert_eq!(avg_tolerance(DType::I64, 8), 0.0);
        let (f32_tol, bf16_tol) = (avg_tolerance(DType::F32, 2), avg_tolerance(DType::BF16, 2));
        assert!(f32_tol < 1e-5 && f32_tol > 0.0, "{f32_tol}");
        assert!(bf16_tol < 0.25 && bf16_tol > f32_tol, "{bf16_tol}");
        // Loose enough for one ulp of 1/3 at 5 (bf16: 0.03), tight enough to catch a
        // sum reported as an average (off by at least 0.5 for these contributions).
        assert!(avg_tolerance(DType::BF16, 3) > 0.03 && avg_tolerance(DType::BF16, 3) < 0.5);
        assert!(avg_tolerance(DType::F16, 8) < 0.1);
    }

    #[test]
    fn compare_within_accepts_rounding_and_rejects_wrong_values() {
        let want = [bf16::from_f32(1.0 / 3.0)];
        let near = [bf16::from_bits(want[0].to_bits() + 1)];
        assert!(compare("x", &near, &want).is_err());
        assert!(compare_within("x", &near, &want, avg_tolerance(DType::BF16, 3)).is_ok());
        assert!(compare_within("x", &[bf16::from_f32(1.0)], &want, 0.1).is_err());
        assert!(compare_within("x", &[f32::NAN], &[0.0f32], 1.0).is_err());
    }

    #[test]
    fn a_dyn_group_downcasts_to_its_implementation() {
        let results = spawn_ranks(1, |g: LocalGroup| {
            let g: std::sync::Arc<dyn ProcessGroup> = std::sync::Arc::new(g);
            (
                g.downcast_ref::<LocalGroup>().is_some(),
                g.downcast_ref::<crate::TcpGroup>().is_some(),
            )
        });
        assert_eq!(results, [(true, false)]);
    }
}
