//! Which units run on which stage: contiguous chunks, balanced by parameter count or by
//! measured cost, or cut at named units.

use crate::PipeError;
use kiln_model::Unit;
use std::fmt;
use std::ops::Range;

/// How to cut the units into chunks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Split {
    /// Contiguous chunks whose largest parameter count is as small as it can be.
    #[default]
    Balanced,
    /// Contiguous chunks whose largest total cost is as small as it can be, given each unit's
    /// cost (one per unit, e.g. from [`measure_costs`](crate::measure_costs)).
    Costs(Vec<u64>),
    /// Balanced by costs measured on this machine: the caller replaces it by
    /// [`Split::Costs`] from [`measure_costs`](crate::measure_costs) (`kiln train` does), since
    /// measuring needs the model, a micro-batch and the whole job.
    Measured,
    /// Chunks beginning at these units (by name, in order; the first chunk begins at unit 0),
    /// PyTorch pipelining's split points.
    At(Vec<String>),
}

/// The units of a model cut into chunks, and the stage of each chunk.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    units: Vec<Unit>,
    sizes: Vec<usize>,
    /// Each unit's cost, when the cut balanced measured costs.
    costs: Option<Vec<u64>>,
    chunks: Vec<Range<usize>>,
    stages: usize,
}

impl Placement {
    /// Cuts `units` (each with its parameter count) into `stages * chunks_per_stage` chunks,
    /// chunk `c` on stage `c % stages`.
    ///
    /// # Errors
    /// More chunks than units; split points that are not units, not in order, or not as many
    /// as the chunks ask.
    pub fn new(
        units: Vec<(Unit, usize)>,
        stages: usize,
        chunks_per_stage: usize,
        split: &Split,
    ) -> Result<Placement, PipeError> {
        let n = stages * chunks_per_stage;
        let (units, sizes): (Vec<Unit>, Vec<usize>) = units.into_iter().unzip();
        if n == 0 || n > units.len() {
            return Err(PipeError::Config(format!(
                "{stages} stages x {chunks_per_stage} chunks need {n} groups of parameters, but the \
                 model has {} units ({})",
                units.len(),
                names(&units)
            )));
        }
        let starts = match split {
            Split::Balanced => balanced(&sizes, n),
            Split::Costs(costs) => {
                if costs.len() != units.len() {
                    return Err(PipeError::Config(format!(
                        "{} unit costs for a model of {} units ({})",
                        costs.len(),
                        units.len(),
                        names(&units)
                    )));
                }
                let costs: Vec<usize> = costs.iter().map(|&c| c as usize).collect();
                balanced(&costs, n)
            }
            Split::Measured => {
                return Err(PipeError::Config(
                    "Split::Measured must be measured first: pass Split::Costs(measure_costs(..))"
                        .into(),
                ));
            }
            Split::At(points) => {
                if points.len() + 1 != n {
                    return Err(PipeError::Config(format!(
                        "{n} chunks need {} split points, got {} ({})",
                        n - 1,
                        points.len(),
                        points.join(",")
                    )));
                }
                let mut starts = vec![0];
                for point in points {
                    let at = units.iter().position(|u| &u.name == point).ok_or_else(|| {
                        PipeError::Config(format!(
                            "split point {point:?} is not a unit of the model ({})",
                            names(&units)
                        ))
                    })?;
                    if at <= *starts.last().expect("not empty") {
                        return Err(PipeError::Config(format!(
                            "split point {point:?} is not after the previous one: split points \
                             name the first unit of each chunk after the first, in order"
                        )));
                    }
                    starts.push(at);
                }
                starts
            }
        };
        let chunks = starts
            .iter()
            .zip(starts.iter().skip(1).chain(std::iter::once(&units.len())))
            .map(|(&a, &b)| a..b)
            .collect();
        let costs = match split {
            Split::Costs(c) => Some(c.clone()),
            _ => None,
        };
        Ok(Placement {
            units,
            sizes,
            costs,
            chunks,
            stages,
        })
    }

    /// The units of chunk `chunk`.
    pub fn chunk(&self, chunk: usize) -> Range<usize> {
        self.chunks[chunk].clone()
    }

    /// The number of chunks.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The stages.
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// The stages whose units read the parameter at `path`, ascending.
    pub fn stages_using(&self, path: &str) -> Vec<usize> {
        let mut stages: Vec<usize> = self
            .chunks
            .iter()
            .enumerate()
            .filter(|(_, r)| self.units[(*r).clone()].iter().any(|u| u.uses(path)))
            .map(|(c, _)| c % self.stages)
            .collect();
        stages.sort_unstable();
        stages.dedup();
        stages
    }

    /// Parameters (elements) held by each stage, a parameter read on several stages counted on
    /// each.
    pub fn stage_sizes(&self) -> Vec<usize> {
        let mut out = vec![0; self.stages];
        for (c, r) in self.chunks.iter().enumerate() {
            out[c % self.stages] += self.sizes[r.clone()].iter().sum::<usize>();
        }
        out
    }
}

/// One line per stage: its chunks' units and parameter count.
impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sizes = self.stage_sizes();
        for (stage, size) in sizes.iter().enumerate() {
            let chunks: Vec<String> = (stage..self.chunks.len())
                .step_by(self.stages)
                .map(|c| {
                    let r = &self.chunks[c];
                    if r.len() == 1 {
                        self.units[r.start].name.clone()
                    } else {
                        format!(
                            "{}..{}",
                            self.units[r.start].name,
                            self.units[r.end - 1].name
                        )
                    }
                })
                .collect();
            let share = match &self.costs {
                Some(costs) => {
                    let total: u64 = costs.iter().sum();
                    let mine: u64 = (stage..self.chunks.len())
                        .step_by(self.stages)
                        .map(|c| costs[self.chunks[c].clone()].iter().sum::<u64>())
                        .sum();
                    format!(
                        ", {:.0}% of the measured compute time",
                        100.0 * mine as f64 / total.max(1) as f64
                    )
                }
                None => String::new(),
            };
            writeln!(
                f,
                "stage {stage}: {} ({} parameters{share})",
                chunks.join(" + "),
                size
            )?;
        }
        Ok(())
    }
}

fn names(units: &[Unit]) -> String {
    let names: Vec<&str> = units.iter().map(|u| u.name.as_str()).collect();
    if names.len() <= 8 {
        names.join(", ")
    } else {
        format!(
            "{}, ..., {}",
            names[..3].join(", "),
            names[names.len() - 2..].join(", ")
        )
    }
}

/// The starts of `n` contiguous non-empty chunks of `sizes` minimising the largest chunk's sum
/// (dynamic programming; the earliest cut among equals, for determinism).
fn balanced(sizes: &[usize], n: usize) -> Vec<usize> {
    let len = sizes.len();
    let mut prefix = vec![0usize; len + 1];
    for (i, s) in sizes.iter().enumerate() {
        prefix[i + 1] = prefix[i] + s;
    }
    // best[k][i]: the smallest largest sum cutting the first i units into k chunks.
    let mut best = vec![vec![usize::MAX; len + 1]; n + 1];
    let mut cut = vec![vec![0usize; len + 1]; n + 1];
    best[0][0] = 0;
    for k in 1..=n {
        for i in k..=len {
            for j in (k - 1)..i {
                if best[k - 1][j] == usize::MAX {
                    continue;
                }
                let cost = best[k - 1][j].max(prefix[i] - prefix[j]);
                if cost < best[k][i] {
                    best[k][i] = cost;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut starts = vec![0; n];
    let mut i = len;
    for k in (1..=n).rev() {
        starts[k - 1] = cut[k][i];
        i = cut[k][i];
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(sizes: &[usize]) -> Vec<(Unit, usize)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| (Unit::new(format!("u{i}"), &[&format!("u{i}")]), s))
            .collect()
    }

    #[test]
    fn balanced_chunks_minimise_the_largest() {
        let p = Placement::new(units(&[4, 1, 1, 1, 1, 4]), 2, 1, &Split::Balanced).unwrap();
        assert_eq!(p.chunk(0), 0..3);
        assert_eq!(p.chunk(1), 3..6);
        assert_eq!(p.stage_sizes(), vec![6, 6]);
        let p = Placement::new(units(&[1, 1, 1, 1, 1, 1, 1, 1]), 2, 2, &Split::Balanced).unwrap();
        assert_eq!(
            (0..4).map(|c| p.chunk(c)).collect::<Vec<_>>(),
            vec![0..2, 2..4, 4..6, 6..8]
        );
        assert_eq!(p.stages_using("u5.weight"), vec![0]);
        assert_eq!(p.stages_using("u3"), vec![1]);
        assert!(
            p.to_string()
                .contains("stage 0: u0..u1 + u4..u5 (4 parameters)"),
            "{p}"
        );
    }

    #[test]
    fn measured_costs_cut_where_parameter_counts_would_not() {
        // An embedding: most parameters, little time; a head: no parameters of its own (tied),
        // the most time.
        let sizes = units(&[8, 2, 2, 2, 0]);
        let by_params = Placement::new(sizes.clone(), 2, 1, &Split::Balanced).unwrap();
        assert_eq!(by_params.chunk(0), 0..1);
        let costs = Split::Costs(vec![1, 3, 3, 3, 5]);
        let by_cost = Placement::new(sizes.clone(), 2, 1, &costs).unwrap();
        assert_eq!(by_cost.chunk(0), 0..3);
        assert_eq!(by_cost.chunk(1), 3..5);
        assert!(
            by_cost
                .to_string()
                .contains("stage 0: u0..u2 (12 parameters, 47% of the measured compute time)"),
            "{by_cost}"
        );
        let err = Placement::new(sizes.clone(), 2, 1, &Split::Costs(vec![1, 2])).unwrap_err();
        assert!(
            err.to_string()
                .contains("2 unit costs for a model of 5 units"),
            "{err}"
        );
        let err = Placement::new(sizes, 2, 1, &Split::Measured).unwrap_err();
        assert!(err.to_string().contains("measure_costs"), "{err}");
    }

    #[test]
    fn split_points_and_errors() {
        let at = |v: &[&str]| Split::At(v.iter().map(|s| s.to_string()).collect());
        let p = Placement::new(units(&[1, 1, 1, 1]), 2, 1, &at(&["u1"])).unwrap();
        assert_eq!(p.chunk(0), 0..1);
        let err = Placement::new(units(&[1, 1, 1]), 4, 1, &Split::Balanced).unwrap_err();
        assert!(
            err.to_string()
                .contains("need 4 groups of parameters, but the model has 3 units"),
            "{err}"
        );
        let err = Placement::new(units(&[1, 1, 1]), 2, 1, &at(&["x"])).unwrap_err();
        assert!(err.to_string().contains("\"x\" is not a unit"), "{err}");
        let err = Placement::new(units(&[1, 1, 1]), 3, 1, &at(&["u2", "u1"])).unwrap_err();
        assert!(err.to_string().contains("not after the previous"), "{err}");
        let err = Placement::new(units(&[1, 1, 1]), 3, 1, &at(&["u2"])).unwrap_err();
        assert!(
            err.to_string().contains("need 2 split points, got 1"),
            "{err}"
        );
    }
}
