//! Batches of next-token pairs from token shards, in llm.c's order (the PyTorch twin,
//! `bench/gpt2_torch.py`, follows the same rule):
//!
//! - the split's shards are taken in file-name order; the position starts at token 0 of the first;
//! - a micro-batch of `B x T` reads the `B*T + 1` tokens `buf = shard[p .. p + B*T + 1]`, inputs
//!   `x = buf[..B*T]` and targets `y = buf[1..]`, each as `[B, T]` row-major; then `p += B*T`;
//! - before reading, if `p + B*T + 1` runs past the shard's end, move to the next shard (after the
//!   last, back to the first) at `p = 0`. Shards shorter than `B*T + 1` tokens are skipped.
//!
//! No shuffling: the order is a pure function of the position `(shard, p)`, which checkpoints
//! record, so a resumed run sees exactly the batches the uninterrupted run would have.
//!
//! Data parallel (`set_stride(rank, world)`): rank `r` of `N` takes micro-batches `r, r + N, ...`
//! of that order (each call walks `N` micro-batches and reads the `r`-th), so the ranks read
//! disjoint batches, N ranks together read what one process would, and the position stays the same
//! on every rank (it is the single-process position after the group's micro-batches).

use super::shards::{list_shards, read_shard, shard_len};
use ferrograd_core::{Error, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the next micro-batch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LoaderPos {
    pub shard: usize,
    pub pos: usize,
}

pub struct TokenLoader {
    shards: Vec<PathBuf>,
    lens: Vec<usize>,
    b: usize,
    t: usize,
    at: LoaderPos,
    /// `(rank, world)`: which micro-batch of each group of `world` this loader reads.
    stride: (usize, usize),
    /// The tokens of `shards[loaded.0]`.
    loaded: Option<(usize, Vec<u16>)>,
}

impl TokenLoader {
    /// The `split` shards of `dir` for micro-batches of `b x t`.
    pub fn new(dir: &Path, split: &str, b: usize, t: usize) -> Result<TokenLoader> {
        if b == 0 || t == 0 {
            return Err(Error::InvalidArgument(format!("batch {b} x context {t}: both must be positive")));
        }
        let shards = list_shards(dir, split)?;
        if shards.is_empty() {
            return Err(Error::File {
                path: dir.display().to_string(),
                msg: format!(
                    "no {split} token shards ({split}_*.bin) here; make them with `ferrograd gpt prepare FILES... --out {}`",
                    dir.display()
                ),
            });
        }
        let lens = shards.iter().map(|p| shard_len(p)).collect::<Result<Vec<_>>>()?;
        let need = b * t + 1;
        if lens.iter().all(|&n| n < need) {
            return Err(Error::File {
                path: dir.display().to_string(),
                msg: format!(
                    "the {split} shards hold at most {} tokens each, but a micro-batch of {b} x {t} needs {need}; \
                     use a smaller --batch or --context (or more text)",
                    lens.iter().max().copied().unwrap_or(0)
                ),
            });
        }
        Ok(TokenLoader { shards, lens, b, t, at: LoaderPos::default(), stride: (0, 1), loaded: None })
    }

    pub fn position(&self) -> LoaderPos {
        self.at
    }

    pub fn set_position(&mut self, at: LoaderPos) -> Result<()> {
        if at.shard >= self.shards.len() || at.pos > self.lens[at.shard] {
            return Err(Error::InvalidArgument(format!(
                "loader position {at:?} is outside the {} shards (were the shards rewritten?)",
                self.shards.len()
            )));
        }
        self.at = at;
        Ok(())
    }

    /// Read micro-batches `rank, rank + world, ...` of the single-process order from now on.
    pub fn set_stride(&mut self, rank: usize, world: usize) -> Result<()> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!("rank {rank} of a world of {world}")));
        }
        self.stride = (rank, world);
        Ok(())
    }

    /// Where the next micro-batch of the single-process order starts; moves past it.
    fn advance(&mut self) -> LoaderPos {
        let n = self.b * self.t;
        // Move on while the current shard cannot hold the batch (terminates: one shard can).
        while self.at.pos + n + 1 > self.lens[self.at.shard] {
            self.at = LoaderPos { shard: (self.at.shard + 1) % self.shards.len(), pos: 0 };
        }
        let at = self.at;
        self.at.pos += n;
        at
    }

    /// Total tokens over the split's shards.
    pub fn total_tokens(&self) -> usize {
        self.lens.iter().sum()
    }

    pub fn shards(&self) -> &[PathBuf] {
        &self.shards
    }

    /// The next micro-batch's `(x, y)`, each `B*T` token ids, row-major `[B, T]`.
    pub fn next_batch(&mut self) -> Result<(Vec<u32>, Vec<u32>)> {
        let n = self.b * self.t;
        let (rank, world) = self.stride;
        let mut mine = self.at;
        for i in 0..world {
            let at = self.advance();
            if i == rank {
                mine = at;
            }
        }
        let s = mine.shard;
        if self.loaded.as_ref().map(|(i, _)| *i) != Some(s) {
            let toks = read_shard(&self.shards[s])?;
            if toks.len() != self.lens[s] {
                return Err(Error::File {
                    path: self.shards[s].display().to_string(),
                    msg: "changed while training (its length differs from when the run started)".into(),
                });
            }
            self.loaded = Some((s, toks));
        }
        let toks = self.loaded.as_ref().map(|(_, t)| t.as_slice()).unwrap_or(&[]);
        let buf = &toks[mine.pos..mine.pos + n + 1];
        let x = buf[..n].iter().map(|&v| v as u32).collect();
        let y = buf[1..].iter().map(|&v| v as u32).collect();
        Ok((x, y))
    }
}

/// The fixed device buffers a step reads its tokens from: `k` micro-batches of `[B, T]` u32 ids
/// and targets. The loader's batches are copied into them before each step, so the step itself
/// always sees the same tensors (what a captured CUDA graph needs).
pub struct StepInputs {
    pub x: Vec<Tensor>,
    pub y: Vec<Tensor>,
}

impl StepInputs {
    pub fn new(k: usize, b: usize, t: usize, device: ferrograd_core::Device) -> Result<StepInputs> {
        let z = || Tensor::zeros((b, t), ferrograd_core::DType::U32, device);
        Ok(StepInputs {
            x: (0..k).map(|_| z()).collect::<Result<_>>()?,
            y: (0..k).map(|_| z()).collect::<Result<_>>()?,
        })
    }

    /// Copy micro-batch `i`'s tokens into its buffers.
    pub fn fill(&self, i: usize, x: Vec<u32>, y: Vec<u32>) -> Result<()> {
        let (xb, yb) = (&self.x[i], &self.y[i]);
        let shape = xb.shape().clone();
        xb.set(&Tensor::from_vec(x, shape.clone(), xb.device())?)?;
        yb.set(&Tensor::from_vec(y, shape, yb.device())?)
    }

    /// Fill every buffer from `loader`.
    pub fn fill_from(&self, loader: &mut TokenLoader) -> Result<()> {
        for i in 0..self.x.len() {
            let (x, y) = loader.next_batch()?;
            self.fill(i, x, y)?;
        }
        Ok(())
    }
}
