//! Tokenizers: kiln's byte-level one (token `i` is byte `i`, so any UTF-8 text round-trips with
//! vocab 256) and a model directory's Hugging Face `tokenizer.json` ([`Tokenizer`]).

use crate::HfError;
use std::path::{Path, PathBuf};

/// The file of a Hugging Face tokenizer in a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The tokenizer a run encodes text with and decodes samples with.
#[derive(Debug, Clone)]
pub enum Tokenizer {
    /// Bytes ([`ByteTokenizer`]): vocabulary 256.
    Bytes,
    /// A Hugging Face `tokenizer.json` (BPE, WordPiece, Unigram... through the `tokenizers`
    /// crate), with the file it came from.
    Hf(Box<tokenizers::Tokenizer>, PathBuf),
}

impl Tokenizer {
    /// Reads a `tokenizer.json`.
    ///
    /// # Errors
    /// A missing file, or one the `tokenizers` crate cannot parse (its reason given).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer, HfError> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(HfError::MissingFile {
                path: path.to_path_buf(),
                what: "the tokenizer",
            });
        }
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| HfError::Tokenizer {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Tokenizer::Hf(Box::new(tok), path.to_path_buf()))
    }

    /// The tokenizer of a model directory: its `tokenizer.json`, or `None` when it has none.
    ///
    /// # Errors
    /// As [`from_file`](Self::from_file), for a file that is there.
    pub fn of_model_dir(dir: impl AsRef<Path>) -> Result<Option<Tokenizer>, HfError> {
        let path = dir.as_ref().join(TOKENIZER_FILE);
        if path.is_file() {
            Self::from_file(path).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => ByteTokenizer::VOCAB_SIZE,
            Tokenizer::Hf(t, _) => t.get_vocab_size(true),
        }
    }

    /// The ids of `text`, without special tokens (training text is a continuous stream).
    ///
    /// # Panics
    /// If the tokenizer fails on the text (a `tokenizers` error; it does not for valid
    /// configurations and UTF-8 input).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Bytes => ByteTokenizer.encode(text),
            Tokenizer::Hf(t, path) => t
                .encode(text, false)
                .unwrap_or_else(|e| panic!("{} cannot encode the text: {e}", path.display()))
                .get_ids()
                .to_vec(),
        }
    }

    /// The text of `ids`. Ids the vocabulary lacks and invalid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Bytes => ByteTokenizer.decode(ids),
            Tokenizer::Hf(t, _) => {
                // Once: the vocabulary size with added tokens builds the whole vocabulary map.
                let vocab = self.vocab_size();
                let known: Vec<u32> = ids
                    .iter()
                    .map(|&id| if (id as usize) < vocab { id } else { u32::MAX })
                    .collect();
                // Decode runs of known ids; an unknown one is one replacement character.
                let mut out = String::new();
                for (i, run) in known.split(|&id| id == u32::MAX).enumerate() {
                    if i > 0 {
                        out.push(char::REPLACEMENT_CHARACTER);
                    }
                    out.push_str(&t.decode(run, false).unwrap_or_default());
                }
                out
            }
        }
    }

    /// What it is, for run logs: `bytes (vocabulary 256)` or the file and its vocabulary.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes (vocabulary 256)".into(),
            Tokenizer::Hf(_, path) => {
                format!("{} (vocabulary {})", path.display(), self.vocab_size())
            }
        }
    }

    /// The `tokenizer.json` it came from, if any.
    pub fn file(&self) -> Option<&Path> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Hf(_, path) => Some(path),
        }
    }
}

/// Byte-level tokenizer (vocabulary: the 256 byte values).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// The vocabulary size.
    pub const VOCAB_SIZE: usize = 256;

    /// The UTF-8 bytes of `text` as token ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// The bytes of `ids`, or `None` if an id is not a byte (>= 256).
    pub fn decode_bytes(&self, ids: &[u32]) -> Option<Vec<u8>> {
        ids.iter().map(|&id| u8::try_from(id).ok()).collect()
    }

    /// The text of `ids`: invalid UTF-8 (e.g. a sampled sequence cut inside a character) and ids
    /// >= 256 become U+FFFD, as `String::from_utf8_lossy` does.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        let mut bytes = Vec::new();
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) => {
                    out.push_str(&String::from_utf8_lossy(&bytes));
                    bytes.clear();
                    out.push(char::REPLACEMENT_CHARACTER);
                }
            }
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer-bpe512")
    }

    /// The ids Python's `tokenizers` gave (`make_tokenizer.py`), and the text back.
    #[test]
    fn tokenizer_json_encodes_as_python_does() {
        let tok = Tokenizer::from_file(fixture().join(TOKENIZER_FILE)).unwrap();
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture().join("expected.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            tok.vocab_size() as u64,
            expected["vocab_size"].as_u64().unwrap()
        );
        for case in expected["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(tok.encode(text), ids, "{text:?}");
            assert_eq!(tok.decode(&ids), text);
        }
        // An id past the vocabulary is one replacement character.
        let mut ids = tok.encode("ab");
        ids.push(9999);
        assert!(tok.decode(&ids).ends_with(char::REPLACEMENT_CHARACTER));
    }

    #[test]
    fn missing_and_broken_tokenizers_are_named() {
        let err = Tokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/tokenizer.json"),
            "{err}"
        );
        let dir = std::env::temp_dir().join(format!("kiln-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(TOKENIZER_FILE), "{\"model\": 3}").unwrap();
        let err = Tokenizer::of_model_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(Tokenizer::of_model_dir("/nonexistent").unwrap().is_none());
    }

    #[test]
    fn round_trips_any_utf8() {
        let t = ByteTokenizer;
        for text in ["", "hello", "größe ☃ 🦀 日本語", "\0\u{7f}\u{80}"] {
            let ids = t.encode(text);
            assert_eq!(ids.len(), text.len());
            assert!(
                ids.iter()
                    .all(|&i| (i as usize) < ByteTokenizer::VOCAB_SIZE)
            );
            assert_eq!(t.decode(&ids), text);
        }
    }

    #[test]
    fn decode_is_lossy_on_bad_input() {
        let t = ByteTokenizer;
        assert_eq!(t.decode(&[104, 300, 105]), "h\u{fffd}i");
        assert_eq!(t.decode(&[0xe2, 0x98]), "\u{fffd}");
        assert_eq!(t.decode_bytes(&[1, 256]), None);
    }
}
