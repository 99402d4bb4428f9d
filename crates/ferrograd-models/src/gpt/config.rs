//! GPT-2's shape: the four published sizes, small ones for tests, and the figures derived from a
//! shape (parameter count, FLOPs per token, the padded vocabulary).

use ferrograd_core::{Error, Result};
use serde::{Deserialize, Serialize};

/// The vocabulary is padded inside the model to a multiple of this (50257 -> 50304): the classifier
/// matmul's output width is then aligned for the tensor cores. The padded rows of `wte` are zero,
/// never receive a gradient and never appear in a file or an output.
pub const VOCAB_ALIGN: usize = 64;
/// GPT-2's vocabulary: 50,000 merges, 256 bytes and `<|endoftext|>`.
pub const GPT2_VOCAB: usize = 50257;
/// `<|endoftext|>`: separates documents in the token shards.
pub const EOT: u32 = 50256;

/// The hyper-parameters of a GPT-2 model, named as Hugging Face's `GPT2Config` names them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// The longest context (rows of `wpe`).
    pub n_positions: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub layer_norm_epsilon: f64,
}

impl GptConfig {
    fn sized(n_layer: usize, n_head: usize, n_embd: usize) -> GptConfig {
        GptConfig { vocab_size: GPT2_VOCAB, n_positions: 1024, n_layer, n_head, n_embd, layer_norm_epsilon: 1e-5 }
    }

    /// GPT-2 small (124M): 12 layers, 12 heads, 768 channels, 1024 positions.
    pub fn gpt2() -> GptConfig {
        Self::sized(12, 12, 768)
    }

    /// `gpt2` (124M), `gpt2-medium` (350M), `gpt2-large` (774M), `gpt2-xl` (1558M).
    pub fn preset(name: &str) -> Result<GptConfig> {
        Ok(match name {
            "gpt2" | "gpt2-small" | "124M" | "124m" => Self::gpt2(),
            "gpt2-medium" | "350M" | "350m" => Self::sized(24, 16, 1024),
            "gpt2-large" | "774M" | "774m" => Self::sized(36, 20, 1280),
            "gpt2-xl" | "1558M" | "1558m" => Self::sized(48, 25, 1600),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown GPT-2 size {name:?}: expected gpt2, gpt2-medium, gpt2-large or gpt2-xl"
                )))
            }
        })
    }

    /// The preset names, for help texts.
    pub const PRESETS: [&'static str; 4] = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"];

    /// A small model for tests and CPU runs (GPT-2's vocabulary, 64 positions unless changed).
    pub fn tiny() -> GptConfig {
        GptConfig { n_positions: 64, ..Self::sized(2, 2, 32) }
    }

    /// Refuse shapes the model cannot be built with, naming the flag to change.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        for (v, what) in [
            (self.vocab_size, "vocab_size"),
            (self.n_positions, "context (n_positions)"),
            (self.n_layer, "layers"),
            (self.n_head, "heads"),
            (self.n_embd, "dim (n_embd)"),
        ] {
            if v == 0 {
                return bad(format!("GPT config: {what} must be positive"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!(
                "GPT config: dim {} is not a multiple of heads {} (each head gets dim/heads channels)",
                self.n_embd, self.n_head
            ));
        }
        if self.vocab_size > u32::MAX as usize / 2 {
            return bad(format!("GPT config: vocab_size {} is too large", self.vocab_size));
        }
        if !(self.layer_norm_epsilon.is_finite() && self.layer_norm_epsilon > 0.0) {
            return bad(format!("GPT config: layer_norm_epsilon {} must be positive", self.layer_norm_epsilon));
        }
        Ok(())
    }

    /// The vocabulary as the model holds it: rounded up to [`VOCAB_ALIGN`].
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.next_multiple_of(VOCAB_ALIGN)
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    /// Parameters as Hugging Face counts them (tied `lm_head` once, no padding): 124,439,808 for gpt2.
    pub fn num_parameters(&self) -> usize {
        let c = self.n_embd;
        let per_layer = 12 * c * c + 13 * c;
        self.vocab_size * c + self.n_positions * c + self.n_layer * per_layer + 2 * c
    }

    /// Training FLOPs per token at context `t` (forward and backward): `6 N` for the weights plus
    /// `12 L C T` for attention's two matmuls (llm.c's and nanoGPT's estimate, used for MFU).
    pub fn flops_per_token(&self, t: usize) -> f64 {
        6.0 * self.num_parameters() as f64 + 12.0 * (self.n_layer * self.n_embd * t) as f64
    }

    /// Hugging Face's `config.json` for this shape (GPT2LMHeadModel, tanh GELU, no dropout: we
    /// train without it).
    pub fn to_hf_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": 0.02,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "reorder_and_upcast_attn": false,
            "tie_word_embeddings": true,
            "bos_token_id": EOT,
            "eos_token_id": EOT,
            "torch_dtype": "float32",
        })
    }

    /// Read Hugging Face's `config.json`, refusing GPT-2 variants this model does not implement.
    pub fn from_hf_json(v: &serde_json::Value) -> Result<GptConfig> {
        let bad = |m: String| Error::InvalidArgument(format!("config.json: {m}"));
        let num = |k: &str| -> Result<usize> {
            v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize).ok_or_else(|| bad(format!("missing or bad {k:?}")))
        };
        if let Some(t) = v.get("model_type").and_then(|x| x.as_str()) {
            if t != "gpt2" {
                return Err(bad(format!("model_type {t:?} is not gpt2")));
            }
        }
        let act = v.get("activation_function").and_then(|x| x.as_str()).unwrap_or("gelu_new");
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") {
            return Err(bad(format!("activation_function {act:?}: only GPT-2's tanh GELU (gelu_new) is implemented")));
        }
        let n_embd = num("n_embd")?;
        if let Some(inner) = v.get("n_inner").and_then(|x| x.as_u64()) {
            if inner as usize != 4 * n_embd {
                return Err(bad(format!("n_inner {inner}: only 4 * n_embd is implemented")));
            }
        }
        for flag in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
            if v.get(flag).and_then(|x| x.as_bool()) == Some(true) {
                return Err(bad(format!("{flag} = true is not implemented")));
            }
        }
        if v.get("scale_attn_weights").and_then(|x| x.as_bool()) == Some(false) {
            return Err(bad("scale_attn_weights = false is not implemented".into()));
        }
        if v.get("tie_word_embeddings").and_then(|x| x.as_bool()) == Some(false) {
            return Err(bad("tie_word_embeddings = false is not implemented (lm_head is wte)".into()));
        }
        let cfg = GptConfig {
            vocab_size: num("vocab_size")?,
            n_positions: num("n_positions").or_else(|_| num("n_ctx"))?,
            n_layer: num("n_layer")?,
            n_head: num("n_head")?,
            n_embd,
            layer_norm_epsilon: v.get("layer_norm_epsilon").and_then(|x| x.as_f64()).unwrap_or(1e-5),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_published_sizes() {
        let n = |s| GptConfig::preset(s).unwrap().num_parameters();
        assert_eq!(n("gpt2"), 124_439_808);
        assert_eq!(n("gpt2-medium"), 354_823_168);
        assert_eq!(n("gpt2-large"), 774_030_080);
        assert_eq!(n("gpt2-xl"), 1_557_611_200);
        assert_eq!(GptConfig::preset("gpt2").unwrap().padded_vocab(), 50304);
        assert!(GptConfig::preset("gpt5").is_err());
    }

    #[test]
    fn hf_json_round_trips_and_refuses_variants() {
        let c = GptConfig { n_positions: 128, ..GptConfig::tiny() };
        assert_eq!(GptConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
        let mut v = c.to_hf_json();
        v["activation_function"] = "relu".into();
        assert!(GptConfig::from_hf_json(&v).unwrap_err().to_string().contains("activation_function"));
        let bad = GptConfig { n_head: 3, ..c };
        assert!(bad.validate().unwrap_err().to_string().contains("multiple of heads"));
    }
}
