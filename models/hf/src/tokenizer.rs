//! A byte-level tokenizer: token `i` is byte `i`, so any UTF-8 text round-trips with vocab 256.

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
