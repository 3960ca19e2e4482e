//! [`DeviceMesh`]: the world as a grid `pp x dp_replicate x dp_shard x tp`, and its sub-groups.
//!
//! Ranks are laid out with `tp` fastest, then `dp_shard`, `dp_replicate`, `pp` (torchtitan's
//! order): tensor-parallel peers, which talk most, are neighbours, hence on one node.

use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use std::sync::Arc;

/// The parallel degrees of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape {
    /// Data-parallel replicas (DDP, or the replicate dimension of hybrid sharding).
    pub dp_replicate: usize,
    /// Data-parallel shards (FSDP / ZeRO).
    pub dp_shard: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
}

impl Default for MeshShape {
    fn default() -> Self {
        MeshShape {
            dp_replicate: 1,
            dp_shard: 1,
            tp: 1,
            pp: 1,
        }
    }
}

impl MeshShape {
    /// The number of ranks the shape needs.
    pub fn size(&self) -> usize {
        self.dp_replicate * self.dp_shard * self.tp * self.pp
    }
}

/// One dimension of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MeshAxis {
    /// Pipeline stages.
    Pp,
    /// Data-parallel replicas.
    DpReplicate,
    /// Data-parallel shards.
    DpShard,
    /// Both data-parallel dimensions together (gradient averaging spans them).
    Dp,
    /// Tensor parallelism.
    Tp,
}

impl MeshAxis {
    /// The axis name, as in the degrees.
    pub fn name(self) -> &'static str {
        match self {
            MeshAxis::Pp => "pp",
            MeshAxis::DpReplicate => "dp_replicate",
            MeshAxis::DpShard => "dp_shard",
            MeshAxis::Dp => "dp",
            MeshAxis::Tp => "tp",
        }
    }
}

/// A rank's coordinates in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshCoords {
    /// Pipeline stage.
    pub pp: usize,
    /// Replica index.
    pub dp_replicate: usize,
    /// Shard index.
    pub dp_shard: usize,
    /// Tensor-parallel index.
    pub tp: usize,
}

/// The world arranged as a grid of parallel dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMesh {
    shape: MeshShape,
}

impl DeviceMesh {
    /// A mesh of `shape` over `world_size` ranks.
    ///
    /// # Errors
    /// [`CommError::Config`] if a degree is zero or the degrees' product is not `world_size`.
    pub fn new(world_size: usize, shape: MeshShape) -> Result<DeviceMesh> {
        let MeshShape {
            dp_replicate,
            dp_shard,
            tp,
            pp,
        } = shape;
        let degrees =
            format!("dp_replicate({dp_replicate}) x dp_shard({dp_shard}) x tp({tp}) x pp({pp})");
        if [dp_replicate, dp_shard, tp, pp].contains(&0) {
            return Err(CommError::Config(format!(
                "{degrees}: every degree must be at least 1"
            )));
        }
        if shape.size() != world_size {
            return Err(CommError::Config(format!(
                "{degrees} = {} but world_size is {world_size}",
                shape.size()
            )));
        }
        Ok(DeviceMesh { shape })
    }

    /// The degrees.
    pub fn shape(&self) -> MeshShape {
        self.shape
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.shape.size()
    }

    /// The coordinates of `rank`.
    ///
    /// # Panics
    /// If `rank` is not below the world size.
    pub fn coords(&self, rank: usize) -> MeshCoords {
        assert!(
            rank < self.world_size(),
            "rank {rank} outside a mesh of {}",
            self.world_size()
        );
        let s = self.shape;
        MeshCoords {
            tp: rank % s.tp,
            dp_shard: rank / s.tp % s.dp_shard,
            dp_replicate: rank / (s.tp * s.dp_shard) % s.dp_replicate,
            pp: rank / (s.tp * s.dp_shard * s.dp_replicate),
        }
    }

    /// The rank at `coords`.
    pub fn rank_of(&self, c: MeshCoords) -> usize {
        let s = self.shape;
        ((c.pp * s.dp_replicate + c.dp_replicate) * s.dp_shard + c.dp_shard) * s.tp + c.tp
    }

    /// The ranks that share every coordinate of `rank` except `axis`, in axis order.
    pub fn axis_ranks(&self, rank: usize, axis: MeshAxis) -> Vec<usize> {
        let c = self.coords(rank);
        let s = self.shape;
        match axis {
            MeshAxis::Pp => (0..s.pp)
                .map(|i| self.rank_of(MeshCoords { pp: i, ..c }))
                .collect(),
            MeshAxis::DpReplicate => (0..s.dp_replicate)
                .map(|i| {
                    self.rank_of(MeshCoords {
                        dp_replicate: i,
                        ..c
                    })
                })
                .collect(),
            MeshAxis::DpShard => (0..s.dp_shard)
                .map(|i| self.rank_of(MeshCoords { dp_shard: i, ..c }))
                .collect(),
            MeshAxis::Tp => (0..s.tp)
                .map(|i| self.rank_of(MeshCoords { tp: i, ..c }))
                .collect(),
            MeshAxis::Dp => (0..s.dp_replicate)
                .flat_map(|r| (0..s.dp_shard).map(move |d| (r, d)))
                .map(|(r, d)| {
                    self.rank_of(MeshCoords {
                        dp_replicate: r,
                        dp_shard: d,
                        ..c
                    })
                })
                .collect(),
        }
    }

    /// This rank's sub-group along every axis. Every rank of `world` must call it.
    ///
    /// # Errors
    /// [`CommError::Config`] if `world`'s size differs from the mesh's.
    pub fn groups(&self, world: &dyn ProcessGroup) -> Result<MeshGroups> {
        if world.world_size() != self.world_size() {
            return Err(CommError::Config(format!(
                "the mesh has {} ranks but group '{}' has {}",
                self.world_size(),
                world.name(),
                world.world_size()
            )));
        }
        let rank = world.rank();
        let split = |axis: MeshAxis| world.split(&self.axis_ranks(rank, axis), axis.name());
        Ok(MeshGroups {
            coords: self.coords(rank),
            pp: split(MeshAxis::Pp)?,
            dp_replicate: split(MeshAxis::DpReplicate)?,
            dp_shard: split(MeshAxis::DpShard)?,
            dp: split(MeshAxis::Dp)?,
            tp: split(MeshAxis::Tp)?,
        })
    }
}

/// One rank's sub-groups of a [`DeviceMesh`].
#[derive(Debug, Clone)]
pub struct MeshGroups {
    /// This rank's coordinates.
    pub coords: MeshCoords,
    /// The ranks of this rank's pipeline.
    pub pp: Arc<dyn ProcessGroup>,
    /// The replicas of this rank's shard.
    pub dp_replicate: Arc<dyn ProcessGroup>,
    /// The shards of this rank's replica.
    pub dp_shard: Arc<dyn ProcessGroup>,
    /// Every data-parallel peer (replicas x shards).
    pub dp: Arc<dyn ProcessGroup>,
    /// This rank's tensor-parallel peers.
    pub tp: Arc<dyn ProcessGroup>,
}

impl MeshGroups {
    /// The sub-group of `axis`.
    pub fn get(&self, axis: MeshAxis) -> &Arc<dyn ProcessGroup> {
        match axis {
            MeshAxis::Pp => &self.pp,
            MeshAxis::DpReplicate => &self.dp_replicate,
            MeshAxis::DpShard => &self.dp_shard,
            MeshAxis::Dp => &self.dp,
            MeshAxis::Tp => &self.tp,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(dp_replicate: usize, dp_shard: usize, tp: usize, pp: usize) -> MeshShape {
        MeshShape {
            dp_replicate,
            dp_shard,
            tp,
            pp,
        }
    }

    #[test]
    fn inconsistent_degrees_name_the_numbers() {
        let err = DeviceMesh::new(8, shape(1, 2, 2, 3))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dp_replicate(1) x dp_shard(2) x tp(2) x pp(3) = 12 but world_size is 8"),
            "{err}"
        );
        assert!(DeviceMesh::new(0, shape(0, 1, 1, 1)).is_err());
    }

    #[test]
    fn coords_round_trip_and_axes_partition_the_world() {
        let mesh = DeviceMesh::new(24, shape(2, 3, 2, 2)).unwrap();
        for rank in 0..24 {
            assert_eq!(mesh.rank_of(mesh.coords(rank)), rank);
        }
        for axis in [
            MeshAxis::Pp,
            MeshAxis::DpReplicate,
            MeshAxis::DpShard,
            MeshAxis::Dp,
            MeshAxis::Tp,
        ] {
            // The axis's groups partition the world into groups of the axis's size.
            let mut groups: Vec<Vec<usize>> = (0..24).map(|r| mesh.axis_ranks(r, axis)).collect();
            groups.sort();
            groups.dedup();
            let size = groups[0].len();
            assert!(groups.iter().all(|g| g.len() == size));
            assert_eq!(
                groups.len() * size,
                24,
                "{axis:?}: disjoint groups cover the world"
            );
            for (rank, members) in (0..24).map(|r| (r, mesh.axis_ranks(r, axis))) {
                assert!(members.contains(&rank));
                // Every member agrees on the group.
                for &m in &members {
                    assert_eq!(mesh.axis_ranks(m, axis), members);
                }
            }
        }
        assert_eq!(mesh.axis_ranks(0, MeshAxis::Tp), [0, 1]);
        assert_eq!(mesh.axis_ranks(0, MeshAxis::DpShard), [0, 2, 4]);
        assert_eq!(mesh.axis_ranks(0, MeshAxis::Dp), [0, 2, 4, 6, 8, 10]);
        assert_eq!(mesh.axis_ranks(0, MeshAxis::Pp), [0, 12]);
    }
}
