//! Lazily initialised parameters are created sharded under ZeRO-3: the whole tensor never
//! exists on any rank. Measured with a counting allocator around `shard`.

use burn::nn::{Linear, LinearConfig};
use kiln_comm::{LocalGroup, spawn_ranks};
use kiln_shard::account::CountingAlloc;
use kiln_shard::check::Train;
use kiln_shard::{ShardConfig, ShardTensor, Strategy, shard};
use std::sync::Arc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

type B = Train<burn::backend::Flex>;

const WIDTH: usize = 2048; // a 16 MiB weight
const RANKS: usize = 4;

#[test]
fn zero3_creates_lazy_parameters_sharded() {
    let whole = WIDTH * WIDTH * 4;
    let before = CountingAlloc::live();
    CountingAlloc::reset_peak();
    let held = spawn_ranks(RANKS, |g: LocalGroup| {
        // Lazy: LinearConfig::init only records how to initialise.
        let model: Linear<B> = LinearConfig::new(WIDTH, WIDTH).init(&Default::default());
        let model = shard(model, Arc::new(g), ShardConfig::new(Strategy::Zero3)).unwrap();
        let prim = model.weight.val().inner().into_primitive().tensor();
        let ShardTensor::Sharded(s) = prim else {
            panic!("the weight is not a shard")
        };
        assert_eq!(s.shape.dims::<2>(), [WIDTH, WIDTH]);
        assert_eq!(s.group.world_size(), RANKS);
        burn::tensor::TensorMetadata::shape(&s.shard).num_elements()
    });
    let peak = CountingAlloc::peak() - before;
    assert_eq!(
        held.iter().sum::<usize>(),
        WIDTH * WIDTH,
        "shards tile the weight"
    );
    // Four whole weights would be 64 MiB; four shards are 16 MiB (+ the random draws' buffers).
    assert!(
        peak < 2 * whole,
        "peak heap while sharding {} MiB: a whole {} MiB weight was materialised",
        peak >> 20,
        whole >> 20
    );
    println!(
        "peak heap while creating {RANKS} sharded {WIDTH}x{WIDTH} weights: {} MiB (whole weight: {} MiB)",
        peak >> 20,
        whole >> 20
    );
}

#[test]
fn ranks_draw_different_values() {
    let firsts = spawn_ranks(2, |g: LocalGroup| {
        let model: Linear<B> = LinearConfig::new(64, 64).init(&Default::default());
        let model = shard(model, Arc::new(g), ShardConfig::new(Strategy::Zero3)).unwrap();
        let data = kiln_shard::local_reads(|| model.weight.val().into_data());
        data.to_vec::<f32>().unwrap()
    });
    assert_eq!(firsts[0].len(), 64 * 64 / 2);
    assert_ne!(
        firsts[0], firsts[1],
        "the two halves of the weight were drawn alike"
    );
}
