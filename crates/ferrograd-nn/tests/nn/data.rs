//! The loader: reproducible shuffling, batching, resuming mid-epoch, errors, early drop.

use crate::common::*;
use ferrograd_core::{DType, Error, Result, Tensor};
use ferrograd_nn::data::*;
use std::sync::Arc;

fn numbered(n: usize) -> Result<Arc<TensorDataset>> {
    let x = Tensor::arange(0.0, n as f64, 1.0, DType::F32, CPU)?.reshape((n, 1))?.broadcast_as((n, 2))?.contiguous()?;
    let y = Tensor::arange(0.0, n as f64, 1.0, DType::I32, CPU)?;
    Ok(Arc::new(TensorDataset::new(vec![x, y])?))
}

fn loader(n: usize, cfg: LoaderConfig) -> Result<DataLoader> {
    DataLoader::new(numbered(n)?, cfg)
}

/// The sample ids of every batch of an epoch, read from the batches themselves.
fn ids(l: &DataLoader, epoch: u64) -> Result<Vec<Vec<i32>>> {
    l.epoch(epoch).map(|b| b?.tensors[1].to_vec::<i32>()).collect()
}

#[test]
fn shuffled_order_is_reproducible_per_epoch() -> Result<()> {
    let cfg = LoaderConfig { batch_size: 4, seed: 17, ..Default::default() };
    let (a, b) = (loader(23, cfg.clone())?, loader(23, cfg.clone())?);
    assert_eq!(ids(&a, 0)?, ids(&b, 0)?, "same seed, same epoch");
    assert_eq!(ids(&a, 5)?, ids(&b, 5)?);
    assert_ne!(ids(&a, 0)?, ids(&a, 1)?, "reshuffled each epoch");
    let other = loader(23, LoaderConfig { seed: 18, ..cfg })?;
    assert_ne!(ids(&a, 0)?, ids(&other, 0)?);
    for e in 0..3 {
        let mut flat: Vec<i32> = ids(&a, e)?.concat();
        assert_ne!(flat, (0..23).collect::<Vec<_>>());
        flat.sort();
        assert_eq!(flat, (0..23).collect::<Vec<_>>(), "a permutation");
    }
    // The order is a pure function of (n, seed, epoch).
    assert_eq!(a.order(3), shuffled_order(23, 17, 3));
    Ok(())
}

#[test]
fn batches_stack_samples_in_order() -> Result<()> {
    let l = loader(10, LoaderConfig { batch_size: 4, shuffle: false, ..Default::default() })?;
    assert_eq!(l.len(), 3);
    let batches: Vec<Batch> = l.epoch(0).collect::<Result<_>>()?;
    assert_eq!(batches.iter().map(|b| b.len()).collect::<Vec<_>>(), [4, 4, 2]);
    assert_eq!(batches.iter().map(|b| b.index).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(
        batches[1].tensors[0].to_vec2::<f32>()?,
        vec![vec![4.0, 4.0], vec![5.0, 5.0], vec![6.0, 6.0], vec![7.0, 7.0]]
    );
    let dl = loader(10, LoaderConfig { batch_size: 4, drop_last: true, ..Default::default() })?;
    assert_eq!(dl.len(), 2);
    assert_eq!(dl.epoch(0).count(), 2);
    assert!(DataLoader::new(numbered(3)?, LoaderConfig { batch_size: 0, ..Default::default() }).is_err());
    Ok(())
}

#[test]
fn resuming_mid_epoch_skips_exactly() -> Result<()> {
    let l = loader(31, LoaderConfig { batch_size: 5, seed: 3, ..Default::default() })?;
    let all = ids(&l, 2)?;
    let rest: Vec<Vec<i32>> = l.epoch_from(2, 4).map(|b| b?.tensors[1].to_vec::<i32>()).collect::<Result<_>>()?;
    assert_eq!(rest, all[4..].to_vec());
    assert_eq!(l.epoch_from(2, 4).next().map(|b| b.map(|b| b.index)).transpose()?, Some(4));
    Ok(())
}

/// A dataset without a batch fast path (the default `get_batch` stacks samples) that fails on one
/// index.
struct Squares {
    fail_at: Option<usize>,
}

impl Dataset for Squares {
    fn len(&self) -> usize {
        12
    }
    fn get(&self, i: usize) -> Result<Vec<Tensor>> {
        if Some(i) == self.fail_at {
            return Err(Error::InvalidArgument(format!("sample {i} is broken")));
        }
        let v = i as f32;
        Ok(vec![Tensor::from_vec(vec![v, v * v], 2, CPU)?, Tensor::scalar(v * v, CPU)?])
    }
}

#[test]
fn default_get_batch_stacks_and_errors_propagate() -> Result<()> {
    let cfg = LoaderConfig { batch_size: 4, shuffle: false, ..Default::default() };
    let l = DataLoader::new(Arc::new(Squares { fail_at: None }), cfg.clone())?;
    let b: Vec<Batch> = l.epoch(0).collect::<Result<_>>()?;
    assert_eq!(b[2].tensors[0].dims(), [4, 2]);
    assert_eq!(b[2].tensors[1].to_vec::<f32>()?, [64.0, 81.0, 100.0, 121.0]);

    let bad = DataLoader::new(Arc::new(Squares { fail_at: Some(6) }), cfg)?;
    let got: Vec<Result<Batch>> = bad.epoch(0).collect();
    assert_eq!(got.len(), 2, "the good batch, then the error, then the end");
    assert!(got[0].is_ok());
    assert!(matches!(&got[1], Err(e) if e.to_string().contains("sample 6")), "{:?}", got[1]);
    Ok(())
}

#[test]
fn dropping_an_epoch_early_stops_the_producer() -> Result<()> {
    let l = loader(1000, LoaderConfig { batch_size: 1, prefetch: 1, ..Default::default() })?;
    for _ in 0..20 {
        let mut it = l.epoch(0);
        it.next().transpose()?;
        // `it` drops here with the producer blocked on a full channel: this must not hang.
    }
    Ok(())
}

#[test]
fn sharded_loaders_together_read_each_global_batch_once() -> Result<()> {
    let cfg = LoaderConfig { batch_size: 6, seed: 9, ..Default::default() };
    let whole = ids(&loader(24, cfg.clone())?, 1)?;
    let parts: Vec<Vec<Vec<i32>>> = (0..3)
        .map(|rank| ids(&loader(24, LoaderConfig { shard: Some(Shard { rank, world: 3 }), ..cfg.clone() })?, 1))
        .collect::<Result<_>>()?;
    for (b, batch) in whole.iter().enumerate() {
        let joined: Vec<i32> = parts.iter().flat_map(|p| p[b].clone()).collect();
        assert_eq!(&joined, batch, "batch {b}: rank slices in rank order make the global batch");
    }
    // A batch or a last batch that does not split evenly is refused up front.
    let bad = |n, batch_size, drop_last| {
        let shard = Some(Shard { rank: 0, world: 4 });
        loader(n, LoaderConfig { batch_size, drop_last, shard, ..Default::default() })
    };
    assert!(matches!(bad(24, 6, false), Err(Error::InvalidArgument(m)) if m.contains("4 ranks")));
    assert!(matches!(bad(26, 8, false), Err(Error::InvalidArgument(m)) if m.contains("drop_last")));
    assert!(bad(26, 8, true).is_ok());
    assert!(Shard { rank: 4, world: 4 }.range(8).is_err());
    Ok(())
}
