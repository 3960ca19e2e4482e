//! The text a run learns, and the order it sees it in.
//!
//! Text becomes tokens through the run's [`Tokenizer`]: a model directory's `tokenizer.json`, or
//! bytes (vocabulary 256), with which any UTF-8 file works and no tokenizer file is needed. The
//! synthetic corpus is a first-order Markov chain over 28
//! characters whose transition table comes from the seed: its entropy rate is the best loss any
//! model can reach (every position sees the previous character), and the entropy of its
//! character frequencies is what a model that ignores context reaches. Both are computed
//! exactly, so a run shows how much of the learnable structure it has learnt.
//!
//! Batches are drawn from a SplitMix64 stream whose state is part of a snapshot: the global
//! batch of a step is the same whatever the world size, and each rank takes an equal,
//! contiguous share of its rows.

use crate::error::{IoContext, Result, TrainError, fail};
use kiln_hf::Tokenizer;
use std::path::Path;

pub use kiln_comm::hash::{SplitMix64, mix};

/// The synthetic corpus' alphabet.
const ALPHABET: &[u8; 28] = b"abcdefghijklmnopqrstuvwxyz .";
/// Probabilities of a character's successors, most likely first.
const SUCCESSORS: [f64; 5] = [0.45, 0.25, 0.15, 0.10, 0.05];

/// A corpus split into training and validation tokens.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Training tokens (bytes).
    pub train: Vec<u32>,
    /// Validation tokens.
    pub validation: Vec<u32>,
    /// Where it came from, for the summary.
    pub description: String,
    /// Entropy (nats) of the training tokens' frequencies: a context-free model's loss.
    pub unigram_entropy: f64,
    /// The best achievable loss (nats), when known (synthetic corpus).
    pub floor: Option<f64>,
}

/// The corpus of a text file's `text`, in `tokenizer`'s tokens: its end held out for validation.
fn file_corpus(text: &str, path: &Path, tokenizer: &Tokenizer, validation_fraction: f64) -> Corpus {
    let tokens = tokenizer.encode(text);
    let cut = split_point(tokens.len(), validation_fraction);
    let train = tokens[..cut].to_vec();
    let description = match tokenizer {
        Tokenizer::Bytes => format!("{} ({} bytes)", path.display(), tokens.len()),
        tok => format!(
            "{} ({} bytes, {} tokens of {})",
            path.display(),
            text.len(),
            tokens.len(),
            tok.describe()
        ),
    };
    Corpus {
        unigram_entropy: unigram_entropy(&train),
        validation: tokens[cut..].to_vec(),
        train,
        description,
        floor: None,
    }
}

impl Corpus {
    /// The corpus a recipe names (`synthetic`, or a text file), in `tokenizer`'s tokens.
    ///
    /// # Errors
    /// A missing or unreadable file, a file too short for one validation and one training
    /// sequence.
    pub fn from_recipe(
        data: &crate::DataRecipe,
        seed: u64,
        seq_len: usize,
        tokenizer: &Tokenizer,
    ) -> Result<Corpus> {
        let corpus = if let crate::DataSource::File(path) = &data.source {
            let path = path.as_path();
            let bytes = std::fs::read(path).io(|| {
                format!(
                    "cannot read the data file {} (data.source; use \"synthetic\" for kiln's own corpus)",
                    path.display()
                )
            })?;
            let text = String::from_utf8(bytes).map_err(|e| {
                TrainError::Data(format!("{} is not UTF-8 text: {e}", path.display()))
            })?;
            file_corpus(&text, path, tokenizer, data.validation_fraction)
        } else {
            let bytes = synthetic(data.synthetic_chars, seed, data.validation_fraction);
            match tokenizer {
                Tokenizer::Bytes => bytes,
                // The chain's entropies are per character: with another tokenizer only the
                // tokens' own frequencies are known.
                tok => {
                    let text = |ids: &[u32]| kiln_hf::ByteTokenizer.decode(ids);
                    let train = tok.encode(&text(&bytes.train));
                    Corpus {
                        unigram_entropy: unigram_entropy(&train),
                        validation: tok.encode(&text(&bytes.validation)),
                        train,
                        description: format!(
                            "{}, tokenized by {}",
                            bytes.description,
                            tok.describe()
                        ),
                        floor: None,
                    }
                }
            }
        };
        let need = seq_len + 2;
        if corpus.train.len() < need || corpus.validation.len() < need {
            fail!(
                Data,
                "the corpus ({}) is too short: training has {} tokens and validation {}, each needs \
                 at least seq_len + 2 = {need}",
                corpus.description,
                corpus.train.len(),
                corpus.validation.len()
            );
        }
        Ok(corpus)
    }
}

fn split_point(len: usize, validation_fraction: f64) -> usize {
    len - (len as f64 * validation_fraction).round() as usize
}

/// The Markov chain of `seed`: row `i` gives `(successor, probability)` pairs.
fn chain(seed: u64) -> Vec<Vec<(usize, f64)>> {
    let n = ALPHABET.len();
    let mut rng = SplitMix64(mix(seed ^ 0x6b69_6c6e));
    (0..n)
        .map(|_| {
            // Distinct successors by a partial Fisher-Yates shuffle.
            let mut order: Vec<usize> = (0..n).collect();
            for i in 0..SUCCESSORS.len() {
                let j = i + rng.below(n - i);
                order.swap(i, j);
            }
            order.iter().copied().zip(SUCCESSORS).collect()
        })
        .collect()
}

/// `chars` characters of the chain of `seed`, and its exact entropies.
pub fn synthetic(chars: usize, seed: u64, validation_fraction: f64) -> Corpus {
    let table = chain(seed);
    let n = ALPHABET.len();
    let mut rng = SplitMix64(mix(seed ^ 0x636f_7270_7573));
    let mut state = rng.below(n);
    let mut tokens = Vec::with_capacity(chars);
    for _ in 0..chars {
        tokens.push(u32::from(ALPHABET[state]));
        let mut u = rng.next_f64();
        let row = &table[state];
        state = row.last().expect("successors").0;
        for &(next, p) in row {
            if u < p {
                state = next;
                break;
            }
            u -= p;
        }
    }
    // The stationary distribution by power iteration; the chain mixes within tens of steps.
    let mut pi = vec![1.0 / n as f64; n];
    for _ in 0..10_000 {
        let mut next = vec![0.0; n];
        for (s, row) in table.iter().enumerate() {
            for &(t, p) in row {
                next[t] += pi[s] * p;
            }
        }
        pi = next;
    }
    let row_entropy: f64 = SUCCESSORS.iter().map(|p| -p * p.ln()).sum();
    let floor = pi.iter().map(|p| p * row_entropy).sum::<f64>();
    let unigram = pi.iter().filter(|&&p| p > 0.0).map(|p| -p * p.ln()).sum();
    let cut = split_point(tokens.len(), validation_fraction);
    Corpus {
        validation: tokens[cut..].to_vec(),
        train: tokens[..cut].to_vec(),
        description: format!("synthetic Markov text ({chars} characters, seed {seed})"),
        unigram_entropy: unigram,
        floor: Some(floor),
    }
}

/// Entropy (nats) of the token frequencies of `tokens`.
pub fn unigram_entropy(tokens: &[u32]) -> f64 {
    let mut counts = std::collections::HashMap::<u32, usize>::new();
    for &t in tokens {
        *counts.entry(t).or_default() += 1;
    }
    let total = tokens.len() as f64;
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / total;
            -p * p.ln()
        })
        .sum()
}

/// One rank's rows of a batch: inputs and next-token targets, `rows x seq_len` each, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Rows in this rank's share.
    pub rows: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Input tokens.
    pub inputs: Vec<i64>,
    /// Targets: the inputs shifted by one.
    pub targets: Vec<i64>,
}

/// The global batch's sequence start offsets for one draw of `rng`, and this rank's rows.
pub fn batch(
    tokens: &[u32],
    rng: &mut SplitMix64,
    global_rows: usize,
    seq_len: usize,
    rank: usize,
    world: usize,
) -> Batch {
    let span = tokens.len() - seq_len - 1;
    // Every rank draws the whole global batch so that the stream stays in step everywhere.
    let starts: Vec<usize> = (0..global_rows).map(|_| rng.below(span + 1)).collect();
    let per_rank = global_rows / world;
    let mine = &starts[rank * per_rank..(rank + 1) * per_rank];
    let mut inputs = Vec::with_capacity(per_rank * seq_len);
    let mut targets = Vec::with_capacity(per_rank * seq_len);
    for &s in mine {
        inputs.extend(tokens[s..s + seq_len].iter().map(|&t| i64::from(t)));
        targets.extend(tokens[s + 1..s + seq_len + 1].iter().map(|&t| i64::from(t)));
    }
    Batch {
        rows: per_rank,
        seq_len,
        inputs,
        targets,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_corpus_is_deterministic_and_its_entropies_match_its_text() {
        let a = synthetic(200_000, 7, 0.1);
        let b = synthetic(200_000, 7, 0.1);
        assert_eq!(a.train, b.train);
        assert_ne!(a.train, synthetic(200_000, 8, 0.1).train);
        assert_eq!(a.validation.len(), 20_000);
        let floor = a.floor.unwrap();
        // The exact unigram entropy agrees with the sampled text's frequencies.
        assert!(
            (a.unigram_entropy - unigram_entropy(&a.train)).abs() < 0.01,
            "{} vs {}",
            a.unigram_entropy,
            unigram_entropy(&a.train)
        );
        // The bigram entropy measured on the text agrees with the floor.
        let mut pair = std::collections::HashMap::<(u32, u32), usize>::new();
        let mut first = std::collections::HashMap::<u32, usize>::new();
        for w in a.train.windows(2) {
            *pair.entry((w[0], w[1])).or_default() += 1;
            *first.entry(w[0]).or_default() += 1;
        }
        let total = (a.train.len() - 1) as f64;
        let measured: f64 = pair
            .iter()
            .map(|(&(x, _), &c)| -(c as f64 / total) * (c as f64 / first[&x] as f64).ln())
            .sum();
        assert!((measured - floor).abs() < 0.01, "{measured} vs {floor}");
        assert!(
            floor < a.unigram_entropy - 1.0,
            "{floor} {}",
            a.unigram_entropy
        );
    }

    #[test]
    fn ranks_split_one_global_batch() {
        let tokens: Vec<u32> = (0..1000).collect();
        let whole = batch(&tokens, &mut SplitMix64(3), 8, 5, 0, 1);
        let mut joined = Vec::new();
        for rank in 0..4 {
            let b = batch(&tokens, &mut SplitMix64(3), 8, 5, rank, 4);
            assert_eq!(b.rows, 2);
            joined.extend(b.inputs);
        }
        assert_eq!(joined, whole.inputs);
        assert!(
            whole
                .inputs
                .iter()
                .zip(&whole.targets)
                .all(|(x, y)| y - x == 1)
        );
    }
}
