//! 64-bit FNV-1a: the one hash kiln uses where every rank (or every run) must derive the same
//! number from the same input without communicating: group ids, seeded initialisation, model
//! fingerprints. And [`SplitMix64`], the one seeded stream kiln draws from where every rank, or
//! a resumed run, must draw the same: batches, adapters' initial values, dropout masks.
//!
//! Not for hash tables facing untrusted keys (it is not DoS-resistant) and not a checksum for
//! files (snapshots use CRC32). Numbers are hashed as their little-endian bytes, so a value is
//! the same on every platform.
//!
//! ```
//! use kiln_comm::hash::{Fnv1a, fnv1a};
//!
//! let mut h = Fnv1a::new();
//! h.write(b"foo");
//! h.write(b"bar");
//! assert_eq!(h.finish(), fnv1a(b"foobar"));
//!
//! // A number is its 8 little-endian bytes.
//! let mut n = Fnv1a::new();
//! n.write_u64(7);
//! assert_eq!(n.finish(), fnv1a(&7u64.to_le_bytes()));
//! ```

/// FNV-1a's 64-bit offset basis (the hash of no bytes).
pub const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV's 64-bit prime.
pub const PRIME: u64 = 0x0100_0000_01b3;

/// The 64-bit FNV-1a hash of `bytes`.
pub const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = OFFSET_BASIS;
    let mut i = 0;
    while i < bytes.len() {
        h = (h ^ bytes[i] as u64).wrapping_mul(PRIME);
        i += 1;
    }
    h
}

/// A streaming 64-bit FNV-1a hasher: the hash of everything written, in order, as one byte
/// string (`write(a); write(b)` equals [`fnv1a`] of `a` followed by `b`).
///
/// It also implements [`std::hash::Hasher`], with integers written as little-endian bytes
/// (the trait's default would use the platform's byte order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fnv1a(u64);

impl Fnv1a {
    /// A hasher that has seen no bytes.
    pub const fn new() -> Self {
        Fnv1a(OFFSET_BASIS)
    }

    /// Hashes `bytes`.
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(PRIME);
        }
    }

    /// Hashes `v` as its 8 little-endian bytes.
    pub fn write_u64(&mut self, v: u64) {
        self.write(&v.to_le_bytes());
    }

    /// The hash of everything written so far (writing may continue).
    pub const fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a::new()
    }
}

impl std::hash::Hasher for Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        Fnv1a::write(self, bytes);
    }
    fn write_u8(&mut self, v: u8) {
        Fnv1a::write(self, &[v]);
    }
    fn write_u16(&mut self, v: u16) {
        Fnv1a::write(self, &v.to_le_bytes());
    }
    fn write_u32(&mut self, v: u32) {
        Fnv1a::write(self, &v.to_le_bytes());
    }
    fn write_u64(&mut self, v: u64) {
        Fnv1a::write_u64(self, v);
    }
    fn write_u128(&mut self, v: u128) {
        Fnv1a::write(self, &v.to_le_bytes());
    }
    fn write_usize(&mut self, v: usize) {
        // As a u64 on every platform, so that 32- and 64-bit ranks agree.
        Fnv1a::write_u64(self, v as u64);
    }
    fn finish(&self) -> u64 {
        Fnv1a::finish(self)
    }
}

/// SplitMix64's increment (the golden ratio's 64-bit fraction).
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, seedable, its whole state one `u64` (which a
/// snapshot stores to resume the stream).
///
/// ```
/// use kiln_comm::hash::{SplitMix64, mix};
/// let mut a = SplitMix64(42);
/// let mut b = SplitMix64(42);
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!(a.below(10) < 10 && (0.0..1.0).contains(&a.next_f64()));
/// // One step from state z is the mixer of z advanced once.
/// assert_eq!(SplitMix64(7).next_u64(), mix(7u64.wrapping_add(0x9e37_79b9_7f4a_7c15)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in [0, 1), from the top 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, 1), from the top 24 bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        // Lemire's multiply-shift: no modulo bias worth the name for n << 2^64.
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// SplitMix64's output function, a bijective mixer: a good 64-bit hash of one number.
pub const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test vectors of the FNV reference (draft-eastlake-fnv, 64-bit FNV-1a).
    const VECTORS: &[(&[u8], u64)] = &[
        (b"", 0xcbf2_9ce4_8422_2325),
        (b"a", 0xaf63_dc4c_8601_ec8c),
        (b"foobar", 0x8594_4171_f739_67e8),
    ];

    #[test]
    fn known_vectors() {
        for &(input, want) in VECTORS {
            assert_eq!(fnv1a(input), want, "{:?}", String::from_utf8_lossy(input));
            let mut h = Fnv1a::new();
            h.write(input);
            assert_eq!(h.finish(), want);
        }
    }

    #[test]
    fn streaming_is_the_hash_of_the_concatenation() {
        let mut h = Fnv1a::default();
        for part in [&b"fo"[..], b"", b"oba", b"r"] {
            h.write(part);
        }
        assert_eq!(h.finish(), fnv1a(b"foobar"));
        let mut n = Fnv1a::new();
        n.write_u64(0x0102_0304_0506_0708);
        n.write_u64(9);
        let bytes = [[8, 7, 6, 5, 4, 3, 2, 1], 9u64.to_le_bytes()].concat();
        assert_eq!(n.finish(), fnv1a(&bytes));
    }

    #[test]
    fn the_hasher_trait_writes_integers_little_endian() {
        use std::hash::Hasher;
        let mut a = Fnv1a::new();
        Hasher::write_usize(&mut a, 5);
        Hasher::write_u32(&mut a, 6);
        let bytes = [5u64.to_le_bytes().as_slice(), &6u32.to_le_bytes()].concat();
        assert_eq!(Hasher::finish(&a), fnv1a(&bytes));
    }

    /// Values fixed before this module replaced the copies in `group.rs` and kiln-train's
    /// `init.rs`: group ids and initial weights must not change.
    #[test]
    fn values_callers_depend_on() {
        let mut world = Fnv1a::new();
        world.write_u64(0x0077_6f72_6c64);
        assert_eq!(world.finish(), 0xf730_b437_f9f4_c921);
        let mut split = Fnv1a::new();
        for p in [world.finish(), 1, 0, 1] {
            split.write_u64(p);
        }
        assert_eq!(split.finish(), 0x28c1_e174_7c77_3262);
        assert_eq!(fnv1a(b"blocks.0.attn.c_attn.weight"), 0x857e_4447_e762_cfb9);
    }
}
