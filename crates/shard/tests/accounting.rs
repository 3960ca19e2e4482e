//! `account::comm_stats` reads the traffic of the groups sharding uses: the group passed to
//! `shard`, or under hybrid sharding the sub-groups it made (which the parent group's counters
//! never see). One training step of a 256 x 256 linear layer at world size 4.

use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Tensor, TensorData};
use kiln_comm::{LocalGroup, OpKind, ProcessGroup, spawn_ranks};
use kiln_shard::account::comm_stats;
use kiln_shard::check::Train;
use kiln_shard::{ShardConfig, ShardedOptimizer, Strategy, shard};
use std::sync::Arc;

type Flex = burn::backend::Flex;
type B = Train<Flex>;

const WIDTH: usize = 256;
const WORLD: usize = 4;

/// (bytes sent by rank 0 over sharding's groups, bytes sent on the world group) in one step.
fn one_step(strategy: Strategy, overlap: bool) -> (u64, u64) {
    let sent = spawn_ranks(WORLD, |g: LocalGroup| {
        let device = Default::default();
        let world: Arc<dyn ProcessGroup> = Arc::new(g);
        let model: Linear<B> = LinearConfig::new(WIDTH, WIDTH).init(&device);
        let model = shard(
            model,
            world.clone(),
            ShardConfig::new(strategy).with_overlap(overlap),
        )
        .unwrap();
        let mut optim = ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Linear<B>>());
        let (before, world_before) = (comm_stats(&model).unwrap(), world.stats());
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(vec![0.5f32; 2 * WIDTH], [2, WIDTH]),
            &device,
        );
        let loss = model.forward(x).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = optim.step(1e-3, model, grads);
        let sent = comm_stats(&model).unwrap().since(&before);
        let on_world = world.stats().since(&world_before);
        drop(model);
        let payload = |s: kiln_comm::CommStats| s.total_sent() - s.get(OpKind::Barrier).bytes_sent;
        (payload(sent), payload(on_world))
    });
    sent[0]
}

#[test]
fn comm_stats_count_sharding_traffic_hybrid_included() {
    let psi_bytes = ((WIDTH + 1) * WIDTH * 4) as f64;
    let ring = 2.0 * (WORLD - 1) as f64 / WORLD as f64 * psi_bytes;

    // DDP: one ring all-reduce of the gradients.
    let (ddp, ddp_world) = one_step(Strategy::Ddp, false);
    assert_eq!(
        ddp, ddp_world,
        "without hybrid or overlap, sharding's group is the world group"
    );
    // With overlap, the same traffic on the communication queue's sub-group. (ZeRO-3 and
    // hybrid below run without: with overlap they also prefetch the next step's first
    // gathers when the step ends, which a one-step count would include.)
    let (ddp_overlap, ddp_overlap_world) = one_step(Strategy::Ddp, true);
    assert_eq!((ddp_overlap, ddp_overlap_world), (ddp, 0));
    assert!(
        (ddp as f64 / ring - 1.0).abs() < 0.01,
        "DDP sent {ddp} B, ring all-reduce {ring} B"
    );

    // ZeRO-3: an all-gather in forward and a reduce-scatter, Ψ (N-1)/N each. (The backward
    // re-gather of ZeRO's 3Ψ is not needed here: the layer's input needs no gradient, so the
    // weight is not read in backward.)
    let (zero3, _) = one_step(Strategy::Zero3, false);
    assert!(
        (zero3 as f64 / ring - 1.0).abs() < 0.01,
        "ZeRO-3 sent {zero3} B, predicted {ring} B"
    );

    // Hybrid 2 x 2: all of it on the sub-groups, none on the world group.
    let (hybrid, hybrid_world) = one_step(Strategy::Hybrid { shard_size: 2 }, false);
    assert_eq!(
        hybrid_world, 0,
        "hybrid sharding talks on its sub-groups only"
    );
    // Within pairs: an all-gather and a reduce-scatter, Ψ/2 each; across pairs: an all-reduce of
    // the half-size shards, 2 (Ψ/2)/2. Together 1.5 Ψ.
    assert!(
        (hybrid as f64 / (1.5 * psi_bytes) - 1.0).abs() < 0.01,
        "hybrid sent {hybrid} B over its sub-groups, predicted {} B",
        1.5 * psi_bytes
    );
}
