//! A dataset is indexable samples, each a list of CPU tensors (input, target, ...) whose shapes
//! agree across samples so that a batch is their stack.

use ferrograd_core::{Device, Error, Result, Tensor};

/// Indexable samples (PyTorch's map-style `Dataset`); a [`DataLoader`](crate::data::DataLoader)
/// batches them.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether there is no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `i` (`i < len()`) as CPU tensors.
    fn get(&self, i: usize) -> Result<Vec<Tensor>>;

    /// The samples at `indices`, each field stacked along a new leading dim. Override this when
    /// the data can be gathered in one go (as `TensorDataset` does).
    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        let samples = indices.iter().map(|&i| self.get(i)).collect::<Result<Vec<_>>>()?;
        let Some(first) = samples.first() else {
            return Err(Error::InvalidArgument("get_batch: no indices".into()));
        };
        (0..first.len())
            .map(|f| {
                let field = samples
                    .iter()
                    .map(|s| {
                        s.get(f).cloned().ok_or_else(|| {
                            Error::InvalidArgument(format!(
                                "samples have different field counts ({} vs {})",
                                s.len(),
                                first.len()
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Tensor::stack(&field, 0)
            })
            .collect()
    }
}

/// Samples are the rows (leading-dim slices) of a few CPU tensors of equal length.
#[derive(Debug, Clone)]
pub struct TensorDataset {
    fields: Vec<Tensor>,
    len: usize,
}

impl TensorDataset {
    /// A dataset over `fields` (`torch.utils.data.TensorDataset`): sample `i` is row `i` of each.
    /// Errors when there is no field, a field is 0-d, or the leading dims differ.
    pub fn new(fields: Vec<Tensor>) -> Result<Self> {
        let first = fields.first().ok_or_else(|| Error::InvalidArgument("TensorDataset needs a tensor".into()))?;
        let len =
            *first.dims().first().ok_or_else(|| Error::InvalidArgument("TensorDataset needs rank >= 1".into()))?;
        for t in &fields {
            if t.dims().first() != Some(&len) {
                return Err(Error::ShapeMismatch {
                    op: "TensorDataset",
                    lhs: first.dims().to_vec(),
                    rhs: t.dims().to_vec(),
                });
            }
            if t.device() != Device::Cpu {
                return Err(Error::DeviceMismatch { op: "TensorDataset", lhs: Device::Cpu, rhs: t.device() });
            }
        }
        // Detached: a dataset is data, never part of a graph.
        Ok(TensorDataset { fields: fields.iter().map(|t| t.detach()).collect(), len })
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, i: usize) -> Result<Vec<Tensor>> {
        if i >= self.len {
            return Err(Error::IndexOutOfRange { op: "TensorDataset::get", index: i as i64, size: self.len });
        }
        self.fields.iter().map(|t| t.narrow(0, i, 1)?.squeeze(0)?.contiguous()).collect()
    }

    /// One `index_select` per field.
    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len) {
            return Err(Error::IndexOutOfRange { op: "TensorDataset::get_batch", index: bad as i64, size: self.len });
        }
        let ids: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        let ids = Tensor::from_vec(ids, indices.len(), Device::Cpu)?;
        self.fields.iter().map(|t| t.index_select(&ids, 0)).collect()
    }
}
