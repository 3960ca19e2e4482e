//! Every collective on in-process ranks, world sizes 1 to 8, plus the failure modes.

use kiln_comm::{
    CommError, DeviceMesh, GroupOptions, LocalGroup, MeshAxis, MeshShape, OpKind, ProcessGroup,
    ReduceOp, selftest, spawn_ranks, spawn_ranks_with,
};
use std::time::{Duration, Instant};

fn short(timeout_ms: u64) -> GroupOptions {
    GroupOptions::default().with_timeout(Duration::from_millis(timeout_ms))
}

#[test]
fn every_collective_and_dtype_for_world_sizes_1_to_8() {
    for world in 1..=8 {
        let reports = spawn_ranks(world, |g: LocalGroup| selftest::run(&g));
        for (rank, r) in reports.into_iter().enumerate() {
            let report = r.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            assert!(report.checks > 300, "world {world}: {report:?}");
        }
    }
}

#[test]
fn ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer() {
    for world in [2usize, 3, 4, 8] {
        let len = 24 * 1000; // divisible by every world size here
        let sent = spawn_ranks(world, |g: LocalGroup| {
            let mut v = vec![1.0f32; len];
            g.all_reduce((&mut v[..]).into(), ReduceOp::Sum).unwrap();
            let s = g.stats().get(OpKind::AllReduce);
            assert_eq!(s.calls, 1);
            assert_eq!(s.bytes_sent, s.bytes_received);
            s.bytes_sent
        });
        let expected = 2 * (world as u64 - 1) * (len as u64 * 4) / world as u64;
        assert!(
            sent.iter().all(|&b| b == expected),
            "world {world}: {sent:?} vs {expected}"
        );
    }
}

#[test]
fn reduce_scatter_and_all_gather_each_send_n_minus_1_over_n() {
    let (world, len) = (4usize, 4000usize);
    spawn_ranks(world, |g: LocalGroup| {
        let input = vec![1.0f32; len];
        let mut shard = vec![0.0f32; len / world];
        g.reduce_scatter((&input[..]).into(), (&mut shard[..]).into(), ReduceOp::Sum)
            .unwrap();
        let mut whole = vec![0.0f32; len];
        g.all_gather((&shard[..]).into(), (&mut whole[..]).into())
            .unwrap();
        assert!(whole.iter().all(|&x| x == world as f32));
        let stats = g.stats();
        let per = (world as u64 - 1) * len as u64 * 4 / world as u64;
        assert_eq!(stats.get(OpKind::ReduceScatter).bytes_sent, per);
        assert_eq!(stats.get(OpKind::AllGather).bytes_sent, per);
    });
}

#[test]
fn results_are_bitwise_identical_on_every_rank() {
    // Float sums depend on the order; the ring reduces each chunk once and copies it.
    let results = spawn_ranks(5, |g: LocalGroup| {
        let mut v: Vec<f32> = (0..1001)
            .map(|i| ((i * 31 + g.rank() * 17) as f32).sin() * 1e3)
            .collect();
        g.all_reduce((&mut v[..]).into(), ReduceOp::Avg).unwrap();
        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    });
    assert!(results.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn mismatched_collectives_are_reported_not_mixed() {
    let errors = spawn_ranks_with(2, short(5000), |g: LocalGroup| {
        let mut v = [0.0f32; 8];
        let result = if g.rank() == 0 {
            g.all_reduce((&mut v[..]).into(), ReduceOp::Sum)
        } else {
            g.broadcast((&mut v[..]).into(), 0)
        };
        result.unwrap_err()
    });
    // Rank 1 receives rank 0's all-reduce message while in its broadcast; rank 0 then learns
    // of it as rank 1 leaves.
    let text = errors[1].to_string();
    assert!(matches!(errors[1], CommError::Mismatch { .. }), "{text}");
    assert!(
        text.contains("broadcast #0 on group 'world' (rank 1 of 2)"),
        "{text}"
    );
    assert!(
        text.contains("rank 0 called all_reduce #0 (f32, 8 elements, op sum)"),
        "{text}"
    );
    let text = errors[0].to_string();
    assert!(
        text.contains("all_reduce #0 on group 'world' (rank 0 of 2)"),
        "{text}"
    );
    assert!(text.contains("mismatched collective"), "{text}");
}

#[test]
fn mismatched_sizes_and_dtypes_are_reported() {
    let errors = spawn_ranks_with(2, short(5000), |g: LocalGroup| {
        let mut v = vec![0.0f32; 8 + g.rank()];
        g.all_reduce((&mut v[..]).into(), ReduceOp::Sum)
            .unwrap_err()
    });
    for text in errors.iter().map(|e| e.to_string()) {
        assert!(text.contains("(f32, 8 elements, op sum)"), "{text}");
        assert!(text.contains("(f32, 9 elements, op sum)"), "{text}");
    }

    let errors = spawn_ranks_with(2, short(5000), |g: LocalGroup| {
        if g.rank() == 0 {
            let mut v = [0i64; 8];
            g.all_reduce((&mut v[..]).into(), ReduceOp::Max)
                .unwrap_err()
        } else {
            let mut v = [kiln_comm::bf16::ZERO; 8];
            g.all_reduce((&mut v[..]).into(), ReduceOp::Max)
                .unwrap_err()
        }
    });
    assert!(errors[0].to_string().contains("bf16"), "{}", errors[0]);
}

#[test]
fn a_rank_that_never_arrives_times_out_with_context() {
    let start = Instant::now();
    let results = spawn_ranks_with(3, short(300), |g: LocalGroup| {
        if g.rank() == 2 {
            // Stays alive but never calls the collective.
            std::thread::sleep(Duration::from_millis(800));
            return None;
        }
        let mut v = [1.0f32; 10];
        Some(
            g.all_reduce((&mut v[..]).into(), ReduceOp::Sum)
                .unwrap_err(),
        )
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let err = results[0].as_ref().unwrap();
    let text = err.to_string();
    assert!(text.contains("all_reduce #0 on group 'world'"), "{text}");
    assert!(
        matches!(err, CommError::Timeout { .. } | CommError::PeerLost { .. }),
        "{text}"
    );
    // Rank 1 waits on rank 0 in the ring; at least one rank reports the timeout itself.
    assert!(
        results
            .iter()
            .flatten()
            .any(|e| matches!(e, CommError::Timeout { .. }))
    );
}

#[test]
fn a_rank_that_dies_fails_its_peers_at_once_and_poisons_the_group() {
    let start = Instant::now();
    let result = std::panic::catch_unwind(|| {
        spawn_ranks_with(3, short(60_000), |g: LocalGroup| {
            if g.rank() == 1 {
                panic!("simulated crash");
            }
            let mut v = [1.0f32; 10];
            let err = g
                .all_reduce((&mut v[..]).into(), ReduceOp::Sum)
                .unwrap_err();
            assert!(matches!(err, CommError::PeerLost { .. }), "{err}");
            assert!(err.to_string().contains("panicked"), "{err}");
            let again = g.barrier().unwrap_err();
            assert!(matches!(again, CommError::Poisoned { .. }), "{again}");
        })
    });
    let msg = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(msg.contains("rank 1 panicked: simulated crash"), "{msg}");
    assert!(
        !msg.contains("rank 0"),
        "survivors passed their assertions: {msg}"
    );
    // Far below the 60 s timeout: the loss was noticed, not waited out.
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_receive_waiting_on_one_thread_holds_up_no_send_or_collective_on_another() {
    // Rank 0 waits for a message on a second thread while its first thread sends and
    // all-reduces; rank 1 sends that message only after both. Had the waiting receive held the
    // group, rank 0's send would wait for it and both ranks would time out.
    let outcomes = spawn_ranks_with(2, short(10_000), |g: LocalGroup| -> Result<(), CommError> {
        let mut sum = [1.0f32];
        if g.rank() == 0 {
            std::thread::scope(|s| {
                let waiting = s.spawn(|| {
                    let mut got = [0.0f32; 3];
                    g.recv((&mut got[..]).into(), 1).map(|()| got)
                });
                // Time for the receive to start waiting (were it late, the test would still
                // pass, without checking anything).
                std::thread::sleep(Duration::from_millis(50));
                g.send((&[1.0f32, 2.0, 3.0][..]).into(), 1)?;
                g.all_reduce((&mut sum[..]).into(), ReduceOp::Sum)?;
                assert_eq!(sum, [2.0]);
                assert_eq!(waiting.join().unwrap()?, [4.0, 5.0, 6.0]);
                Ok(())
            })
        } else {
            let mut got = [0.0f32; 3];
            g.recv((&mut got[..]).into(), 0)?;
            assert_eq!(got, [1.0, 2.0, 3.0]);
            g.all_reduce((&mut sum[..]).into(), ReduceOp::Sum)?;
            g.send((&[4.0f32, 5.0, 6.0][..]).into(), 0)
        }
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        outcome.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

#[test]
fn wrong_lengths_and_peers_are_argument_errors() {
    spawn_ranks(2, |g: LocalGroup| {
        let mut out = [0.0f32; 10];
        let bad = [0.0f32; 6];
        let e = g
            .all_gather((&bad[..]).into(), (&mut out[..]).into())
            .unwrap_err();
        assert!(
            e.to_string().contains("input has 6 elements but rank"),
            "{e}"
        );
        let e = g.send((&bad[..]).into(), 5).unwrap_err();
        assert!(
            e.to_string().contains("destination 5 is out of range"),
            "{e}"
        );
        let mut small = [0.0f32; 3];
        let e = g
            .reduce_scatter((&out[..]).into(), (&mut small[..]).into(), ReduceOp::Sum)
            .unwrap_err();
        assert!(e.to_string().contains("output has 3 elements"), "{e}");
        // Argument errors are local: the group stays usable.
        g.barrier().unwrap();
    });
}

#[test]
fn mesh_sub_groups_reduce_along_their_axis() {
    let shape = MeshShape {
        dp_replicate: 2,
        dp_shard: 2,
        tp: 2,
        pp: 1,
    };
    spawn_ranks(8, |g: LocalGroup| {
        let mesh = DeviceMesh::new(8, shape).unwrap();
        let groups = mesh.groups(&g).unwrap();
        for axis in [
            MeshAxis::Tp,
            MeshAxis::DpShard,
            MeshAxis::DpReplicate,
            MeshAxis::Dp,
            MeshAxis::Pp,
        ] {
            let sub = groups.get(axis);
            let members = mesh.axis_ranks(g.rank(), axis);
            assert_eq!(sub.world_size(), members.len());
            assert_eq!(members[sub.rank()], g.rank());
            let mut v = [g.rank() as i64];
            sub.all_reduce((&mut v[..]).into(), ReduceOp::Sum).unwrap();
            assert_eq!(
                v[0],
                members.iter().map(|&m| m as i64).sum::<i64>(),
                "{axis:?}"
            );
        }
    });
    let err = spawn_ranks(2, |g: LocalGroup| {
        DeviceMesh::new(
            4,
            MeshShape {
                dp_shard: 4,
                ..Default::default()
            },
        )
        .unwrap()
        .groups(&g)
        .unwrap_err()
        .to_string()
    });
    assert!(
        err[0].contains("the mesh has 4 ranks but group 'world' has 2"),
        "{}",
        err[0]
    );
}
