//! How a flat buffer splits over the ranks of a group.
//!
//! The first `len % world` ranks hold one element more than the others, so shards differ in
//! size by at most one element and every length is allowed (the layout `torch.tensor_split`
//! uses). Collectives that split a buffer ([`all_gather`](crate::ProcessGroup::all_gather),
//! [`reduce_scatter`](crate::ProcessGroup::reduce_scatter)) use this layout.

use std::ops::Range;

/// The range of a `len`-element buffer that `rank` of `world` holds.
///
/// # Panics
/// If `world` is zero or `rank >= world`.
pub fn shard_range(len: usize, world: usize, rank: usize) -> Range<usize> {
    assert!(
        rank < world,
        "shard_range: rank {rank} out of range for world size {world}"
    );
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    let size = base + usize::from(rank < extra);
    start..start + size
}

/// The number of elements `rank` of `world` holds of a `len`-element buffer.
pub fn shard_len(len: usize, world: usize, rank: usize) -> usize {
    shard_range(len, world, rank).len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_buffer_and_differ_by_at_most_one() {
        for len in 0..40 {
            for world in 1..9 {
                let mut next = 0;
                let sizes: Vec<usize> = (0..world)
                    .map(|r| {
                        let range = shard_range(len, world, r);
                        assert_eq!(range.start, next, "len {len} world {world} rank {r}");
                        next = range.end;
                        range.len()
                    })
                    .collect();
                assert_eq!(next, len);
                let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                assert!(max - min <= 1);
            }
        }
    }

    #[test]
    fn ten_over_four_is_3_3_2_2() {
        let sizes: Vec<_> = (0..4).map(|r| shard_len(10, 4, r)).collect();
        assert_eq!(sizes, [3, 3, 2, 2]);
    }
}
