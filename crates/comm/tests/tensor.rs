//! The Burn tensor adapter, on Flex tensors, in f32 and bf16.

use burn_flex::Flex;
use burn_tensor::{DType, Tensor, TensorData};
use kiln_comm::{LocalGroup, ProcessGroup, ReduceOp, shard_range, spawn_ranks, tensor};

type B = Flex;

fn rows(n: usize, cols: usize, offset: f32) -> Tensor<B, 2> {
    let v: Vec<f32> = (0..n * cols).map(|i| i as f32 + offset).collect();
    Tensor::from_data(TensorData::new(v, [n, cols]), &Default::default())
}

#[test]
fn all_reduce_keeps_dtype_and_shape() {
    spawn_ranks(3, |g: LocalGroup| {
        let t = rows(2, 3, g.rank() as f32).cast(DType::BF16);
        let out = tensor::all_reduce(&g, t, ReduceOp::Sum).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        assert_eq!(out.dims(), [2, 3]);
        let want: Vec<f32> = (0..6).map(|i| 3.0 * i as f32 + 3.0).collect();
        assert_eq!(
            out.cast(DType::F32).into_data().to_vec::<f32>().unwrap(),
            want
        );
    });
}

#[test]
fn uneven_row_shards_gather_and_scatter() {
    let (total, cols) = (7, 3);
    spawn_ranks(3, |g: LocalGroup| {
        let whole = rows(total, cols, 0.0);
        let mine = shard_range(total, 3, g.rank());
        let shard = whole.clone().slice([mine.clone(), 0..cols]);
        let gathered = tensor::all_gather_rows(&g, shard, total).unwrap();
        assert_eq!(gathered.to_data(), whole.to_data());

        let summed = tensor::reduce_scatter_rows(&g, whole.clone(), ReduceOp::Sum).unwrap();
        let want = whole.slice([mine, 0..cols]).mul_scalar(3.0);
        assert_eq!(summed.into_data(), want.into_data());
    });
}

#[test]
fn broadcast_and_point_to_point() {
    spawn_ranks(2, |g: LocalGroup| {
        let t = rows(2, 2, 10.0 * g.rank() as f32);
        let b = tensor::broadcast(&g, t.clone(), 1).unwrap();
        assert_eq!(b.into_data(), rows(2, 2, 10.0).into_data());
        if g.rank() == 0 {
            tensor::send(&g, t, 1).unwrap();
        } else {
            let got = tensor::recv(&g, rows(2, 2, -1.0), 0).unwrap();
            assert_eq!(got.into_data(), rows(2, 2, 0.0).into_data());
        }
    });
}

#[test]
fn a_wrong_shard_is_an_error_naming_rows() {
    spawn_ranks(2, |g: LocalGroup| {
        let e = tensor::all_gather_rows(&g, rows(1, 2, 0.0), 5).unwrap_err();
        assert!(e.to_string().contains("the shard has 1 rows"), "{e}");
    });
}
