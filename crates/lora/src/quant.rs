//! QLoRA's 4-bit base (Dettmers et al. 2023): NF4 blocks with double-quantised block scales, in
//! bitsandbytes' layout, and their dequantisation on the device.
//!
//! A matrix is quantised in PyTorch's `nn.Linear` layout `[out, in]` (the transpose of Burn's
//! `Linear` weight), flattened, in blocks of [`BLOCK`] = 64 values, as bitsandbytes' `Linear4bit`
//! does: each block is scaled by its largest magnitude (`absmax`) into `[-1, 1]`, and each value
//! becomes the index of the nearest of the 16 [`NF4`] levels (quantiles of a normal
//! distribution), two indices per byte, the first in the high nibble. Double quantisation
//! stores the block scales in 8 bits too: their mean is subtracted (`offset`), and the rest is
//! quantised in blocks of [`ABSMAX_BLOCK`] = 256 to the nearest value of bitsandbytes' signed
//! dynamic map ([`dynamic_map`]) times the block's own largest magnitude (one f32 per 256
//! blocks). A value therefore costs 4 bits + 8/64 bits + 32/16384 bits, about 4.127 bits: 0.129 of
//! f32.
//!
//! Why kiln's own NF4 rather than Burn 0.21's block quantisation: Burn's 4-bit schemes are
//! linear (symmetric int4), not the normal-quantile levels the paper shows matter for weights,
//! have no double quantisation, and Burn's CPU backend stores each 4-bit value in a whole byte
//! (`QuantStore::Native`), so the base would cost 0.28 of f32 on the CPU instead of 0.13. The
//! codes here are plain `u8` int tensors, which every Burn backend holds at one byte per two
//! values, and dequantisation is two table lookups (`select`) and a multiply, on any backend.

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, IntDType, Tensor, TensorData};

/// Values per block sharing one scale.
pub const BLOCK: usize = 64;

/// Block scales per second-level block (double quantisation).
pub const ABSMAX_BLOCK: usize = 256;

/// The 16 NF4 levels (bitsandbytes' `_NF4_QUANT_TABLE`: the normalised quantiles of N(0, 1),
/// with an exact zero).
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// The index of NF4's zero: the code of padding.
const NF4_ZERO: u8 = 7;

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`): for exponents
/// `e = 0..7`, `2^e` fraction levels, the midpoints of `linspace(0.1, 1, 2^e + 1)`, scaled by
/// `10^(e - 6)` and mirrored; plus 0 and 1; sorted. Dense near zero, as scales centred on their
/// mean are.
///
/// Computed in f64 and rounded: torch's f32 `linspace` (vectorised, so its rounding depends on
/// the CPU's vector width) gives some levels one bit apart.
pub fn dynamic_map() -> &'static [f32; 256] {
    static MAP: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    MAP.get_or_init(make_dynamic_map)
}

/// The index of the dynamic map's 0: the code of padding scales.
const DYNAMIC_ZERO: u8 = 127;

fn make_dynamic_map() -> [f32; 256] {
    let mut data = Vec::with_capacity(256);
    for e in 0..7i32 {
        let items = (1usize << e) + 1;
        let step = 0.9 / (items - 1) as f64;
        let scale = 10f64.powi(e - 6);
        for k in 0..items - 1 {
            let lo = 0.1 + step * k as f64;
            let mid = (lo + (lo + step)) / 2.0;
            data.push((scale * mid) as f32);
            data.push((-scale * mid) as f32);
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.sort_by(f32::total_cmp);
    data.try_into().expect("the dynamic map has 256 levels")
}

/// The index of the level of the sorted `table` nearest to `x` (the lower one on a tie).
fn nearest(table: &[f32], x: f32) -> u8 {
    let i = table.partition_point(|&t| t < x);
    let i = if i == 0 {
        0
    } else if i == table.len() || x - table[i - 1] <= table[i] - x {
        i - 1
    } else {
        i
    };
    i as u8
}

/// Blockwise quantisation of `values` to the levels of `table`: the codes, and each block's
/// largest magnitude. A block of zeros gets scale 0 and the code of the level nearest 0.
fn quantize_blocks(values: &[f32], block: usize, table: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len().div_ceil(block));
    for chunk in values.chunks(block) {
        let absmax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if absmax > 0.0 { 1.0 / absmax } else { 0.0 };
        codes.extend(
            chunk
                .iter()
                .map(|&v| nearest(table, (v * inv).clamp(-1.0, 1.0))),
        );
        scales.push(absmax);
    }
    (codes, scales)
}

/// A matrix in NF4 with double-quantised scales, on the host: what [`Nf4Weight`] holds on the
/// device, and the reference its dequantisation is tested against.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Matrix {
    /// Rows of the quantised layout (`out`).
    pub rows: usize,
    /// Columns (`in`).
    pub cols: usize,
    /// Two 4-bit codes per byte, the first value in the high nibble; the last block padded with
    /// NF4's zero to a whole block.
    pub codes: Vec<u8>,
    /// Each block's scale minus `offset`, as an index into [`dynamic_map`].
    pub absmax_codes: Vec<u8>,
    /// The largest magnitude of each [`ABSMAX_BLOCK`] of centred scales.
    pub absmax_scales: Vec<f32>,
    /// The mean of the block scales.
    pub offset: f32,
}

impl Nf4Matrix {
    /// Quantises the row-major `[rows, cols]` matrix `values`.
    ///
    /// # Panics
    /// When `values` does not hold `rows * cols` numbers.
    pub fn quantize(values: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(
            values.len(),
            rows * cols,
            "NF4: values for a {rows}x{cols} matrix"
        );
        let (mut codes, absmax) = quantize_blocks(values, BLOCK, &NF4);
        codes.resize(absmax.len() * BLOCK, NF4_ZERO);
        let packed = codes.chunks(2).map(|p| (p[0] << 4) | p[1]).collect();
        let offset = if absmax.is_empty() {
            0.0
        } else {
            (absmax.iter().map(|&a| a as f64).sum::<f64>() / absmax.len() as f64) as f32
        };
        let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
        let (absmax_codes, absmax_scales) = quantize_blocks(&centred, ABSMAX_BLOCK, dynamic_map());
        Nf4Matrix {
            rows,
            cols,
            codes: packed,
            absmax_codes,
            absmax_scales,
            offset,
        }
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the matrix has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The block scales as double quantisation gives them back.
    pub fn absmax(&self) -> Vec<f32> {
        let map = dynamic_map();
        self.absmax_codes
            .chunks(ABSMAX_BLOCK)
            .zip(&self.absmax_scales)
            .flat_map(|(codes, &s)| codes.iter().map(move |&c| map[c as usize] * s))
            .map(|a| a + self.offset)
            .collect()
    }

    /// The row-major `[rows, cols]` values the codes stand for.
    pub fn dequantize(&self) -> Vec<f32> {
        let absmax = self.absmax();
        let mut out = Vec::with_capacity(self.codes.len() * 2);
        for (block, bytes) in self.codes.chunks(BLOCK / 2).enumerate() {
            for &b in bytes {
                out.push(NF4[(b >> 4) as usize] * absmax[block]);
                out.push(NF4[(b & 15) as usize] * absmax[block]);
            }
        }
        out.truncate(self.len());
        out
    }

    /// The bytes it takes: codes, scale codes, second-level scales and the offset.
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.absmax_codes.len() + 4 * self.absmax_scales.len() + 4
    }
}

/// The NF4 pair table: entry `b` is the two values of the byte `b` (high nibble first), so one
/// `select` unpacks and looks up both codes of a byte.
fn pair_table() -> &'static [f32] {
    static PAIRS: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    PAIRS.get_or_init(|| {
        (0..256usize)
            .flat_map(|b| [NF4[b >> 4], NF4[b & 15]])
            .collect()
    })
}

/// A frozen weight stored 4-bit on the device and dequantised on use: QLoRA's base weight.
///
/// Codes are `u8` int tensors (module parameters, so they move with the module); the
/// second-level scales and the offset (4 bytes per 16,384 values) stay on the host and are
/// uploaded with each dequantisation.
#[derive(Module, Debug)]
pub struct Nf4Weight<B: Backend> {
    /// Packed 4-bit codes, `[blocks * 32]`.
    pub codes: Param<Tensor<B, 1, Int>>,
    /// Block scale codes, padded to whole second-level blocks.
    pub absmax_codes: Param<Tensor<B, 1, Int>>,
    /// Second-level scales.
    #[module(skip)]
    pub absmax_scales: Vec<f32>,
    /// The scales' mean.
    #[module(skip)]
    pub offset: f32,
    /// Burn's layout of the weight: `[in, out]`.
    #[module(skip)]
    pub dims: [usize; 2],
}

impl<B: Backend> Nf4Weight<B> {
    /// Quantises the Burn `Linear` weight `w` (`[in, out]`).
    pub fn quantize(w: Tensor<B, 2>) -> Self {
        let [fan_in, fan_out] = w.dims();
        let device = w.device();
        let values = w
            .transpose()
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 data");
        Self::upload(&Nf4Matrix::quantize(&values, fan_out, fan_in), &device)
    }

    /// Places a host matrix (in `[out, in]` layout) on `device`.
    pub fn upload(m: &Nf4Matrix, device: &B::Device) -> Self {
        let mut absmax_codes = m.absmax_codes.clone();
        // Padding decodes to the offset and is cut off before use.
        absmax_codes.resize(m.absmax_scales.len() * ABSMAX_BLOCK, DYNAMIC_ZERO);
        let ints = |v: Vec<u8>| {
            let n = v.len();
            let t = Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), (device, DType::U8));
            Param::initialized(ParamId::new(), t)
        };
        Nf4Weight {
            codes: ints(m.codes.clone()),
            absmax_codes: ints(absmax_codes),
            absmax_scales: m.absmax_scales.clone(),
            offset: m.offset,
            dims: [m.cols, m.rows],
        }
    }

    /// Whether this is an empty placeholder (another pipeline stage holds the weight).
    pub fn is_placeholder(&self) -> bool {
        self.codes.shape().num_elements() == 0
    }

    /// The weight in Burn's layout `[in, out]`, in the default float dtype: two lookups and two
    /// multiplies, nothing kept (a constant for autodiff).
    pub fn dequantize(&self) -> Tensor<B, 2> {
        // Under a remat budget the weight is held, not tracked: fourteen recorded ops per
        // weight made the pool thrash (the Llama benchmark under a 100 MiB budget went from
        // 4.7 s a step with LoRA to none finished in 150 s), and the weight plays the part
        // the f32 base's weight plays under LoRA, which is never recorded either.
        kiln_shard::remat::not_recording(|| self.dequantize_now())
    }

    fn dequantize_now(&self) -> Tensor<B, 2> {
        let [fan_in, fan_out] = self.dims;
        let n = fan_in * fan_out;
        let codes = self.codes.val();
        let device = codes.device();
        let blocks = n.div_ceil(BLOCK);
        let groups = self.absmax_scales.len();
        let map =
            Tensor::<B, 1>::from_data(TensorData::new(dynamic_map().to_vec(), [256]), &device);
        let scales = Tensor::<B, 1>::from_data(
            TensorData::new(self.absmax_scales.clone(), [groups]),
            &device,
        );
        let absmax = map
            .select(0, self.absmax_codes.val().cast(IntDType::I32))
            .reshape([groups, ABSMAX_BLOCK])
            .mul(scales.reshape([groups, 1]))
            .reshape([groups * ABSMAX_BLOCK])
            .slice(0..blocks)
            .add_scalar(self.offset)
            .reshape([blocks, 1]);
        let pairs =
            Tensor::<B, 2>::from_data(TensorData::new(pair_table().to_vec(), [256, 2]), &device);
        pairs
            .select(0, codes.cast(IntDType::I32))
            .reshape([blocks, BLOCK])
            .mul(absmax)
            .reshape([blocks * BLOCK])
            .slice(0..n)
            .reshape([fan_out, fan_in])
            .transpose()
    }

    /// The bytes it takes on the device and the host.
    pub fn bytes(&self) -> usize {
        self.codes.val().dims()[0]
            + self.absmax_codes.val().dims()[0]
            + 4 * self.absmax_scales.len()
            + 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Φ⁻¹ by bisection on erfc-free Φ (a series good to 1e-12 in the range used).
    fn normal_ppf(p: f64) -> f64 {
        fn cdf(x: f64) -> f64 {
            // Φ(x) = 1/2 + φ(x) Σ x^(2k+1) / (1·3·…·(2k+1)), converging for all x.
            let mut term = x;
            let mut sum = x;
            for k in 1..400 {
                term *= x * x / (2 * k + 1) as f64;
                sum += term;
            }
            0.5 + sum * (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt()
        }
        let (mut lo, mut hi) = (-10.0, 10.0);
        for _ in 0..200 {
            let mid = (lo + hi) / 2.0;
            if cdf(mid) < p { lo = mid } else { hi = mid }
        }
        (lo + hi) / 2.0
    }

    #[test]
    fn nf4_levels_are_the_papers_normal_quantiles() {
        // QLoRA's construction (bitsandbytes' create_normal_map, offset 0.9677): 8 positive
        // quantiles, 7 negative, and zero, normalised to [-1, 1].
        let offset = 0.967_708_3;
        let lin =
            |n: usize| (0..n).map(move |i| offset + (0.5 - offset) * i as f64 / (n - 1) as f64);
        let mut v: Vec<f64> = lin(9).take(8).map(normal_ppf).collect();
        v.extend(lin(8).take(7).map(|p| -normal_ppf(p)));
        v.push(0.0);
        let max = v.iter().cloned().fold(0.0, f64::max);
        let mut v: Vec<f64> = v.into_iter().map(|x| x / max).collect();
        v.sort_by(f64::total_cmp);
        for (ours, paper) in NF4.iter().zip(&v) {
            assert!((*ours as f64 - paper).abs() < 1e-6, "{ours} vs {paper}");
        }
    }

    #[test]
    fn dynamic_map_has_256_sorted_levels_with_zero_and_one() {
        let m = dynamic_map();
        assert!(m.windows(2).all(|w| w[0] < w[1]), "distinct and sorted");
        // The coarsest level is the last midpoint of linspace(0.1, 1, 65).
        assert_eq!((m[0], m[255]), (-(1.0 - 0.9 / 128.0), 1.0));
        assert_eq!(m[DYNAMIC_ZERO as usize], 0.0);
        // The finest level is 10^-6 times the first midpoint, 0.55.
        assert!((m[128] - 5.5e-7).abs() < 1e-12);
    }

    #[test]
    fn codes_are_the_nearest_levels_packed_high_nibble_first() {
        // One block: absmax 2, so the values scale to -1, 0.5 (nearest 0.4407, not 0.5626), 0, 1.
        let mut values = vec![0.0f32; 64];
        values[..4].copy_from_slice(&[-2.0, 1.0, 0.0, 2.0]);
        let q = Nf4Matrix::quantize(&values, 1, 64);
        assert_eq!(q.codes.len(), 32);
        assert_eq!(q.codes[0], 12); // codes 0 and 12
        assert_eq!(q.codes[1], (7 << 4) | 15);
        assert_eq!(q.codes[2], 0x77);
        // One scale: centred to 0, it decodes exactly.
        assert_eq!(q.absmax(), vec![2.0]);
        let d = q.dequantize();
        assert_eq!(&d[..4], &[-2.0, 2.0 * NF4[12], 0.0, 2.0]);
    }

    #[test]
    fn round_trip_error_is_bounded_by_half_a_level_gap() {
        // A normal-ish matrix whose size is not a multiple of the blocks.
        let (rows, cols) = (37, 29);
        let mut rng = kiln_comm::hash::SplitMix64(12345);
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| ((0..4).map(|_| rng.next_f32()).sum::<f32>() - 2.0) * 0.05)
            .collect();
        let q = Nf4Matrix::quantize(&values, rows, cols);
        assert_eq!(q.codes.len(), 17 * 32);
        assert_eq!(q.absmax_codes.len(), 17);
        let d = q.dequantize();
        assert_eq!(d.len(), values.len());
        let widest = NF4.windows(2).map(|w| w[1] - w[0]).fold(0.0, f32::max);
        let absmax_true: Vec<f32> = values
            .chunks(BLOCK)
            .map(|c| c.iter().fold(0f32, |m, v| m.max(v.abs())))
            .collect();
        for (b, (a, t)) in q.absmax().iter().zip(&absmax_true).enumerate() {
            // Double quantisation: within the dynamic map's resolution of the centred scales.
            assert!((a - t).abs() <= 0.02 * t, "block {b}: scale {a} vs {t}");
        }
        for (i, (x, y)) in values.iter().zip(&d).enumerate() {
            let bound = absmax_true[i / BLOCK] * (widest / 2.0 + 0.03);
            assert!((x - y).abs() <= bound, "value {i}: {x} -> {y}");
        }
        // About 4.13 bits per value (plus padding of the last block).
        let bits = 8.0 * q.bytes() as f64 / values.len() as f64;
        assert!(bits < 4.5, "{bits} bits per value");
    }

    #[test]
    fn zero_matrix_quantises_to_zero() {
        let q = Nf4Matrix::quantize(&[0.0; 130], 10, 13);
        assert!(q.dequantize().iter().all(|&v| v == 0.0));
    }
}
