//! kiln's NF4 with double quantisation against bitsandbytes' own (`fixtures/make_nf4_fixture.py`,
//! bitsandbytes 0.50.2): the same dynamic map, the same packed codes, block-scale codes,
//! second-level scales and offset, and the same dequantised values, on the host and through a
//! Burn backend.

use burn::tensor::Tensor;
use kiln::{Flex, Train};
use kiln_hf::SafetensorsFile;
use kiln_lora::quant::{Nf4Matrix, Nf4Weight, dynamic_map};

fn fixture() -> SafetensorsFile {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/nf4-bitsandbytes.safetensors");
    SafetensorsFile::open(path, "bitsandbytes' NF4 fixture").unwrap()
}

fn floats(f: &SafetensorsFile, name: &str) -> Vec<f32> {
    f.float(name, None).unwrap().into_vec::<f32>().unwrap()
}

fn bytes(f: &SafetensorsFile, name: &str) -> Vec<u8> {
    let v = f.int(name).unwrap().into_vec::<i64>().unwrap();
    v.into_iter().map(|x| u8::try_from(x).unwrap()).collect()
}

#[test]
fn dynamic_map_is_bitsandbytes() {
    let theirs = floats(&fixture(), "dynamic_map");
    let ours = dynamic_map();
    // Within a bit: torch's vectorised f32 linspace rounds some levels the other way.
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() <= 1.2e-7 * b.abs(), "level {i}: {a} vs {b}");
    }
}

#[test]
fn quantisation_and_dequantisation_are_bitsandbytes() {
    let f = fixture();
    for name in ["a", "b"] {
        let shape = f.shape(&format!("{name}.weight")).unwrap();
        let (rows, cols) = (shape[0], shape[1]);
        let w = floats(&f, &format!("{name}.weight"));
        let q = Nf4Matrix::quantize(&w, rows, cols);
        // bitsandbytes packs to an even count only; kiln pads the last block with zero codes.
        let codes = bytes(&f, &format!("{name}.codes"));
        assert_eq!(&q.codes[..codes.len()], &codes[..], "{name}: packed codes");
        assert!(q.codes[codes.len()..].iter().all(|&b| b == 0x77));
        assert_eq!(
            q.absmax_codes,
            bytes(&f, &format!("{name}.absmax_codes")),
            "{name}"
        );
        // The offset is the scales' mean: torch sums in f32 (in its own order), kiln in f64,
        // so it and the centred scales' maxima may differ in the last bit.
        let scales = floats(&f, &format!("{name}.absmax_scales"));
        for (a, b) in q.absmax_scales.iter().zip(&scales) {
            assert!((a - b).abs() <= 2e-7 * b, "{name}: scales {a} vs {b}");
        }
        let offset = floats(&f, &format!("{name}.offset"))[0];
        assert!(
            (q.offset - offset).abs() <= 2e-7 * offset,
            "{name}: {} vs {offset}",
            q.offset
        );
        let want = floats(&f, &format!("{name}.dequantized"));
        let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = |got: &[f32]| {
            got.iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / max
        };
        assert!(
            err(&q.dequantize()) < 1e-6,
            "{name}: host {}",
            err(&q.dequantize())
        );
        // On a backend (kiln's decorator over Flex), from Burn's [in, out] layout.
        let device = Default::default();
        let burn_w = Tensor::<Train<Flex>, 1>::from_floats(w.as_slice(), &device)
            .reshape([rows, cols])
            .transpose();
        let deq = Nf4Weight::quantize(burn_w).dequantize().transpose();
        let got = deq.into_data().into_vec::<f32>().unwrap();
        assert!(err(&got) < 1e-6, "{name}: device {}", err(&got));
    }
}
