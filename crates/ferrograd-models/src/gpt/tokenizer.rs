//! The GPT-2 tokenizer: byte-level BPE `r50k_base` through the `tiktoken-rs` crate, whose merge
//! table is embedded in the crate (no file or network access at run time).

use super::config::EOT;
use ferrograd_core::{Error, Result};
use std::sync::OnceLock;
use tiktoken_rs::CoreBPE;

pub struct Tokenizer {
    bpe: CoreBPE,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokenizer(r50k_base)")
    }
}

impl Tokenizer {
    /// The shared GPT-2 tokenizer (built once per process, about 0.1 s).
    pub fn gpt2() -> Result<&'static Tokenizer> {
        static TOK: OnceLock<std::result::Result<Tokenizer, String>> = OnceLock::new();
        TOK.get_or_init(|| tiktoken_rs::r50k_base().map(|bpe| Tokenizer { bpe }).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::InvalidArgument(format!("building the GPT-2 tokenizer: {e}")))
    }

    /// Token ids of `text`. `<|endoftext|>` in the text is ordinary text here, not the special
    /// token: documents are separated by [`EOT`] explicitly.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// The bytes of `ids` (a token may end inside a UTF-8 character; see [`Tokenizer::decode`]).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        self.bpe.decode_bytes(ids).map_err(|e| Error::InvalidArgument(format!("decoding tokens: {e:?}")))
    }

    /// Text of `ids`; bytes that do not form UTF-8 (a sequence cut inside a character) become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    pub fn eot(&self) -> u32 {
        EOT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ids_and_round_trip() {
        let t = Tokenizer::gpt2().unwrap();
        // The ids `tiktoken.get_encoding("gpt2")` gives.
        assert_eq!(t.encode("Hello world"), vec![15496, 995]);
        let text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  naïve café — 日本語 🎉";
        assert_eq!(t.decode(&t.encode(text)).unwrap(), text);
        assert_eq!(t.decode(&[EOT]).unwrap(), "<|endoftext|>");
        assert!(t.encode("<|endoftext|>").len() > 1, "special text is ordinary text");
    }
}
