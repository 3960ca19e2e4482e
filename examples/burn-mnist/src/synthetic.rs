//! kiln: a stand-in for burn's `MnistDataset` (which downloads MNIST): 28x28 images of a class's
//! stroke pattern plus deterministic noise, made on demand from the index, so the same index is
//! the same image in every process.

use burn::data::dataset::Dataset;

/// burn's `vision::MnistItem`.
#[derive(Debug, Clone, PartialEq)]
pub struct MnistItem {
    /// Pixels, 0 to 255.
    pub image: [[f32; 28]; 28],
    /// The digit.
    pub label: u8,
}

/// Synthetic digits: `len` images, the `salt` choosing which.
#[derive(Debug, Clone)]
pub struct MnistDataset {
    len: usize,
    salt: u64,
}

impl MnistDataset {
    /// The training split's 60,000 images (made on demand).
    pub fn train() -> Self {
        MnistDataset {
            len: 60_000,
            salt: 1,
        }
    }

    /// The test split's 10,000 images.
    pub fn test() -> Self {
        MnistDataset {
            len: 10_000,
            salt: 2,
        }
    }
}

fn mix(mut x: u64) -> u64 {
    // splitmix64
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Dataset<MnistItem> for MnistDataset {
    fn get(&self, index: usize) -> Option<MnistItem> {
        if index >= self.len {
            return None;
        }
        let seed = mix(self.salt << 32 ^ index as u64);
        let label = (seed % 10) as u8;
        let mut image = [[0f32; 28]; 28];
        for (r, row) in image.iter_mut().enumerate() {
            for (c, px) in row.iter_mut().enumerate() {
                // A class-specific pattern of bars and rings, and noise.
                let l = f32::from(label);
                let ring =
                    (((r as f32 - 14.0).powi(2) + (c as f32 - 14.0).powi(2)).sqrt() - 3.0 - l)
                        .abs()
                        < 1.5;
                let bar = (c + r * (label as usize % 3)).is_multiple_of(label as usize + 3);
                let noise = (mix(seed ^ (r * 28 + c) as u64) % 64) as f32;
                *px = if ring || bar { 255.0 - noise } else { noise };
            }
        }
        Some(MnistItem { image, label })
    }

    fn len(&self) -> usize {
        self.len
    }
}
