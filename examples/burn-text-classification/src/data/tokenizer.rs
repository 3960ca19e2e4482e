// This module defines a trait `Tokenizer` that represents a common interface for all tokenizer
// types used in the text classification library. A specific implementation of this trait,
// `BertCasedTokenizer`, uses the BERT cased tokenization strategy provided by the `tokenizers` library.

// This trait represents the common interface for all tokenizer types.
// The `Send + Sync` bounds are necessary for allowing these operations
// to work across thread boundaries.
#[allow(dead_code)]
pub trait Tokenizer: Send + Sync {
    /// Converts a text string into a sequence of tokens.
    fn encode(&self, value: &str) -> Vec<usize>;

    /// Converts a sequence of tokens back into a text string.
    fn decode(&self, tokens: &[usize]) -> String;

    /// Gets the size of the tokenizer's vocabulary.
    fn vocab_size(&self) -> usize;

    /// Gets the token used for padding sequences to a consistent length.
    fn pad_token(&self) -> usize;

    /// Gets the string representation of the padding token.
    /// The default implementation uses `decode` on the padding token.
    fn pad_token_value(&self) -> String {
        self.decode(&[self.pad_token()])
    }
}

/// kiln: a word-level tokenizer made here (upstream: `BertCasedTokenizer`, the Hugging Face
/// hub's `bert-base-cased`, downloaded): each word hashed into a vocabulary of 1,024 ids; 0 pads,
/// 1 starts a text.
#[derive(Default)]
pub struct WordTokenizer;

impl Tokenizer for WordTokenizer {
    fn encode(&self, value: &str) -> Vec<usize> {
        let words = value.split_whitespace().map(|w| {
            let h = w
                .bytes()
                .fold(5381usize, |h, b| h.wrapping_mul(33) ^ b as usize);
            2 + h % (self.vocab_size() - 2)
        });
        std::iter::once(1).chain(words).collect()
    }

    fn decode(&self, tokens: &[usize]) -> String {
        tokens
            .iter()
            .map(|t| format!("<{t}>"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn vocab_size(&self) -> usize {
        1024
    }

    fn pad_token(&self) -> usize {
        0
    }
}
