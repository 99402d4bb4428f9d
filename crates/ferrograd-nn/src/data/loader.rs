//! The loader. A producer thread walks the epoch's order, gathers each batch on the CPU (pinning
//! its large tensors when the target is a GPU, so their copies are DMAs that do not block the
//! host) and queues it in a bounded channel. The consumer side moves batch k+1 to the device before handing batch k to
//! the training step (double buffering): the copy is queued ahead of the step that follows.
//!
//! The copy of batch k+1 is a `Prefetch` on the device's copy stream: it runs beside step k, and
//! only when batch k+1 is handed out is the compute stream ordered after it (`Prefetch::wait`).

use super::shuffle::shuffled_order;
use super::Dataset;
use ferrograd_core::{Device, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

/// How a [`DataLoader`] batches, shuffles, prefetches and where it delivers (defaults: batch 32,
/// shuffled with seed 0, 2 batches ahead, CPU, pin batches of at least 1 MiB, no shard).
#[derive(Debug, Clone, PartialEq)]
pub struct LoaderConfig {
    /// Samples per batch (the global batch under a shard).
    pub batch_size: usize,
    /// Reshuffle every epoch (from `seed` and the epoch number); otherwise dataset order.
    pub shuffle: bool,
    /// Seed of the shuffle.
    pub seed: u64,
    /// Drop a last batch smaller than `batch_size`.
    pub drop_last: bool,
    /// Batches the producer may prepare ahead of the consumer.
    pub prefetch: usize,
    /// Where batches are delivered.
    pub device: Device,
    /// For a GPU target, page-lock batch tensors of at least this many bytes. Below about a
    /// megabyte the driver's own staged copy is as fast and pinning costs more than it saves
    /// (core's transfer code uses the same threshold).
    pub pin_min_bytes: usize,
    /// Data parallel: deliver only this rank's slice of each batch (the batch of `batch_size`
    /// samples is the global one, cut into `world` equal slices), so that the ranks together see
    /// exactly what one process would, whatever their number.
    pub shard: Option<Shard>,
}

/// Which slice of every batch this process reads (`rank` of `world`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
}

impl Shard {
    /// The slice `[rank * n / world, (rank + 1) * n / world)` of `n` items; `n` must divide evenly
    /// (unequal slices would weigh samples unequally once gradients are averaged).
    pub fn range(&self, n: usize) -> Result<std::ops::Range<usize>> {
        if self.world == 0 || self.rank >= self.world {
            return Err(Error::InvalidArgument(format!("shard: rank {} of world size {}", self.rank, self.world)));
        }
        if !n.is_multiple_of(self.world) {
            return Err(Error::InvalidArgument(format!(
                "a batch of {n} samples does not split evenly over {} ranks",
                self.world
            )));
        }
        let per = n / self.world;
        Ok(self.rank * per..(self.rank + 1) * per)
    }
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch_size: 32,
            shuffle: true,
            seed: 0,
            drop_last: false,
            prefetch: 2,
            device: Device::Cpu,
            pin_min_bytes: 1 << 20,
            shard: None,
        }
    }
}

/// Batches of a [`Dataset`] on a device, gathered by a producer thread and copied ahead of use
/// (`torch.utils.data.DataLoader` with `pin_memory=True` and a prefetch). Iterate an epoch with
/// [`DataLoader::epoch`].
pub struct DataLoader {
    dataset: Arc<dyn Dataset>,
    /// Its settings.
    pub config: LoaderConfig,
}

/// One batch: its position in the epoch and its fields on the target device.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// Its position in the epoch.
    pub index: usize,
    /// Its fields (input, target, ...) on the target device.
    pub tensors: Vec<Tensor>,
}

impl Batch {
    /// Number of samples (the leading dim of the first field).
    pub fn len(&self) -> usize {
        self.tensors.first().and_then(|t| t.dims().first().copied()).unwrap_or(0)
    }

    /// Whether the batch holds no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DataLoader {
    /// A loader; errors for a zero batch size, or a shard that the batch (or the last batch, unless
    /// `drop_last`) does not split evenly.
    pub fn new(dataset: Arc<dyn Dataset>, config: LoaderConfig) -> Result<Self> {
        if config.batch_size == 0 {
            return Err(Error::InvalidArgument("DataLoader: batch_size must be positive".into()));
        }
        if let Some(sh) = config.shard {
            sh.range(config.batch_size)
                .map_err(|e| Error::InvalidArgument(format!("DataLoader: batch_size {}: {e}", config.batch_size)))?;
            let last = dataset.len() % config.batch_size;
            if !config.drop_last && !last.is_multiple_of(sh.world) {
                return Err(Error::InvalidArgument(format!(
                    "DataLoader: the last batch of an epoch holds {last} samples, which do not split over {} ranks; \
                     set drop_last or pick a batch size that divides the dataset ({} samples)",
                    sh.world,
                    dataset.len()
                )));
            }
        }
        Ok(DataLoader { dataset, config })
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// Batches per epoch.
    pub fn len(&self) -> usize {
        let (n, b) = (self.dataset.len(), self.config.batch_size);
        if self.config.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// Whether an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample indices in the order epoch `epoch` visits them.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let n = self.dataset.len();
        if self.config.shuffle {
            shuffled_order(n, self.config.seed, epoch)
        } else {
            (0..n).collect()
        }
    }

    /// The index lists of epoch `epoch`'s batches (this rank's slices when sharded).
    pub fn batch_indices(&self, epoch: u64) -> Vec<Vec<usize>> {
        let order = self.order(epoch);
        let batches = order.chunks(self.config.batch_size).take(self.len());
        match self.config.shard {
            // `new` checked that every batch splits evenly.
            Some(sh) => batches.map(|c| sh.range(c.len()).map(|r| c[r].to_vec()).unwrap_or_default()).collect(),
            None => batches.map(|c| c.to_vec()).collect(),
        }
    }

    /// Iterate over epoch `epoch`.
    pub fn epoch(&self, epoch: u64) -> Batches {
        self.epoch_from(epoch, 0)
    }

    /// Iterate over epoch `epoch` starting at batch `start` (resuming mid-epoch).
    pub fn epoch_from(&self, epoch: u64, start: usize) -> Batches {
        let batches: Vec<(usize, Vec<usize>)> = self.batch_indices(epoch).into_iter().enumerate().skip(start).collect();
        let (tx, rx) = sync_channel(self.config.prefetch.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let (ds, device, flag) = (self.dataset.clone(), self.config.device, stop.clone());
        let pin_min = self.config.pin_min_bytes;
        let producer = std::thread::Builder::new().name("ferrograd-loader".into()).spawn(move || {
            for (index, ids) in batches {
                if flag.load(Ordering::Relaxed) {
                    return;
                }
                let made = ds.get_batch(&ids).and_then(|ts| prepare_host(ts, device, pin_min)).map(|ts| (index, ts));
                let failed = made.is_err();
                // A closed channel means the consumer is gone: stop quietly.
                if tx.send(made).is_err() || failed {
                    return;
                }
            }
        });
        let (handle, spawn_err) = match producer {
            Ok(h) => (Some(h), None),
            Err(e) => (None, Some(Error::Io(e))),
        };
        Batches { epoch, rx: Some(rx), stop, handle, in_flight: None, deferred: spawn_err, device, started: false }
    }
}

/// On the producer thread: detach the batch from any graph and, for a GPU target, page-lock the
/// large tensors.
fn prepare_host(tensors: Vec<Tensor>, device: Device, pin_min: usize) -> Result<Vec<Tensor>> {
    tensors
        .into_iter()
        .map(|t| {
            let t = t.detach();
            if t.device() != Device::Cpu {
                return Err(Error::DeviceMismatch { op: "Dataset::get_batch", lhs: Device::Cpu, rhs: t.device() });
            }
            if !device.is_cuda() || t.elem_count() * t.dtype().size_in_bytes() < pin_min {
                return Ok(t);
            }
            t.pin_memory()
        })
        .collect()
}

/// A batch index and its tensors on the host, as the producer thread sends them.
type HostBatch = (usize, Vec<Tensor>);

/// A batch whose tensors are still travelling to the device.
struct InFlight {
    epoch: u64,
    index: usize,
    tensors: Vec<ferrograd_core::Prefetch>,
}

impl InFlight {
    fn ready(self) -> Result<Batch> {
        let tensors = self.tensors.into_iter().map(|p| p.wait()).collect::<Result<Vec<_>>>()?;
        Ok(Batch { epoch: self.epoch, index: self.index, tensors })
    }
}

/// An epoch in progress. Dropping it stops the producer thread.
pub struct Batches {
    epoch: u64,
    rx: Option<Receiver<Result<HostBatch>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    /// The next batch, its transfer to the device already issued.
    in_flight: Option<InFlight>,
    /// An error met while prefetching, reported after the batch before it has been handed out.
    deferred: Option<Error>,
    device: Device,
    started: bool,
}

impl Batches {
    /// Receive the next host batch and start its transfer; `None` at the end of the epoch.
    fn fetch(&mut self) -> Option<Result<InFlight>> {
        let rx = self.rx.as_ref()?;
        let (index, host) = match rx.recv() {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => return Some(Err(e)),
            Err(_) => return None,
        };
        // From pinned memory each copy is queued on the copy stream and returns at once.
        match host.iter().map(|t| t.to_device_async(self.device)).collect::<Result<Vec<_>>>() {
            Ok(tensors) => Some(Ok(InFlight { epoch: self.epoch, index, tensors })),
            Err(e) => Some(Err(e)),
        }
    }
}

impl Iterator for Batches {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if !self.started {
            self.started = true;
            if let Some(e) = self.deferred.take() {
                return Some(Err(e));
            }
            match self.fetch() {
                Some(Ok(b)) => self.in_flight = Some(b),
                Some(Err(e)) => return Some(Err(e)),
                None => return None,
            }
        }
        let ready = match self.in_flight.take() {
            Some(b) => b.ready(),
            None => return self.deferred.take().map(Err),
        };
        // Queue the following batch's copy before the caller's step on `ready`.
        match self.fetch() {
            Some(Ok(b)) => self.in_flight = Some(b),
            Some(Err(e)) => self.deferred = Some(e),
            None => {}
        }
        Some(ready)
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Closing the channel unblocks a producer waiting to send.
        self.rx.take();
        if let Some(h) = self.handle.take() {
            // A panicking dataset has already reported through the channel closing; nothing to add.
            let _ = h.join();
        }
    }
}
