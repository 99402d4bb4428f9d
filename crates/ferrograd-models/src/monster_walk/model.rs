//! The autoencoder 71-47-23-11-5-11-23-47-71: eight Linear layers with ReLU between them and a
//! linear output. Weights are named as PyTorch's `nn.Sequential` names them (`0.weight`,
//! `0.bias`, `2.weight`, ...; ReLUs sit at the odd indices), so a PyTorch model loads our files
//! and we load its.

use ferrograd_core::{DType, Device, Error, Result, Rng, Tensor};
use ferrograd_nn::checkpoint::{self, LoadOptions, TrainState};
use ferrograd_nn::{Linear, Module};
use std::path::Path;

#[derive(Clone, Debug)]
pub struct Autoencoder {
    /// The eight Linear layers (ferrograd-nn's, weight `[out, in]` and bias `[out]`, leaf variables).
    pub layers: Vec<Linear>,
}

/// (in, out) of the eight Linear layers 71→47→23→11→5→11→23→47→71 (9,690 parameters). The
/// issue text says "nine weight/bias pairs"; the spec's widths and parameter count give eight.
pub const LAYERS: [(usize, usize); 8] = [(71, 47), (47, 23), (23, 11), (11, 5), (5, 11), (11, 23), (23, 47), (47, 71)];

impl Autoencoder {
    /// The layers as (W, b) pairs; the tensors share storage with the model's, so writing into
    /// them changes the model (the persistent kernel writes its trained weights back this way).
    /// Every Monster Walk layer has a bias.
    pub fn weight_pairs(&self) -> Result<Vec<(Tensor, Tensor)>> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| match &l.bias {
                Some(b) => Ok((l.weight.clone(), b.clone())),
                None => Err(Error::InvalidArgument(format!("Monster Walk layer {i} has no bias"))),
            })
            .collect()
    }

    /// PyTorch's `nn.Linear` default init: weight and bias uniform in ±1/sqrt(fan_in), drawn layer
    /// by layer (weight, then bias) from the seeded Philox stream. The bound is computed as
    /// `1/sqrt(fan_in)` directly (not through `Linear::new`'s kaiming arithmetic, which may differ
    /// in the last bit), so a seed gives the weights it always gave.
    pub fn init(seed: u64, device: Device) -> Result<Autoencoder> {
        let mut rng = Rng::new(seed);
        let mut layers = Vec::with_capacity(LAYERS.len());
        for &(fan_in, fan_out) in &LAYERS {
            let bound = 1.0 / (fan_in as f64).sqrt();
            let w = Tensor::rand_with(&mut rng, -bound, bound, (fan_out, fan_in), DType::F32, device)?;
            let b = Tensor::rand_with(&mut rng, -bound, bound, fan_out, DType::F32, device)?;
            layers.push(Linear::from_tensors(w, Some(b)));
        }
        Ok(Autoencoder { layers })
    }

    /// (weight, bias) of each layer, input side first.
    pub fn weights_and_biases(&self) -> Result<Vec<(&Tensor, &Tensor)>> {
        self.layers
            .iter()
            .map(|l| l.bias.as_ref().map(|b| (&l.weight, b)))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::InvalidArgument("a Monster Walk layer has no bias".into()))
    }

    pub fn parameters(&self) -> Vec<Tensor> {
        Module::parameters(self)
    }

    pub fn parameter_count(&self) -> usize {
        self.num_parameters()
    }

    /// PyTorch `nn.Sequential` names: Linear layers at even indices (ReLUs at the odd ones).
    pub fn names() -> Vec<String> {
        (0..LAYERS.len()).flat_map(|i| [format!("{}.weight", 2 * i), format!("{}.bias", 2 * i)]).collect()
    }

    /// The reconstruction of a batch of rows (`Module::forward`, callable without the trait).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Module::forward(self, x)
    }

    /// Mean squared reconstruction error of a batch of rows.
    pub fn loss(&self, x: &Tensor) -> Result<Tensor> {
        Module::forward(self, x)?.mse_loss(x)
    }

    /// Write the weights as safetensors with PyTorch's names (f32), atomically, through
    /// ferrograd-nn's checkpoint writer (the file also carries its `format` metadata, which
    /// `safetensors.torch.load_file` ignores).
    pub fn save(&self, path: &Path) -> Result<()> {
        Ok(checkpoint::save(path, self, None, &TrainState::default())?)
    }

    /// Load the eight weight/bias pairs from a safetensors file with PyTorch's names; every missing,
    /// misshapen, non-f32, unexpected or non-finite tensor is an error naming it.
    pub fn load(path: &Path, device: Device) -> Result<Autoencoder> {
        Self::load_with(path, device, LoadOptions::default())
    }

    /// [`load`](Self::load) with options (`allow_nonfinite`).
    pub fn load_with(path: &Path, device: Device, opts: LoadOptions) -> Result<Autoencoder> {
        let m = Self::init(0, device)?;
        checkpoint::load_with(path, &m, None, opts)?;
        Ok(m)
    }
}

/// Linear layers with ReLU between them and a linear output; parameters under PyTorch's
/// `nn.Sequential` names.
impl Module for Autoencoder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        let last = self.layers.len().saturating_sub(1);
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i < last {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        for (i, l) in self.layers.iter().enumerate() {
            l.visit_parameters(&ferrograd_nn::module::join_name(prefix, &(2 * i).to_string()), f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_and_parameter_count() -> Result<()> {
        let m = Autoencoder::init(1, Device::Cpu)?;
        assert_eq!(m.parameter_count(), 9_690);
        assert_eq!(Autoencoder::names()[..3], ["0.weight", "0.bias", "2.weight"]);
        // The module's names are PyTorch's nn.Sequential names, in order.
        let named: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(named, Autoencoder::names());
        let x = Tensor::rand_with(&mut Rng::new(2), 0.0, 1.0, (5, 71), DType::F32, Device::Cpu)?;
        assert_eq!(m.forward(&x)?.dims(), &[5, 71]);
        Ok(())
    }

    #[test]
    fn save_load_round_trip_and_bad_files() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("fg-mw-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.safetensors");
        let m = Autoencoder::init(3, Device::Cpu)?;
        m.save(&path)?;
        let back = Autoencoder::load(&path, Device::Cpu)?;
        for (a, b) in m.parameters().iter().zip(back.parameters()) {
            assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
        }
        let e = Autoencoder::load(&dir.join("missing.safetensors"), Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("missing.safetensors"), "{e}");
        std::fs::write(&path, b"not a safetensors file")?;
        assert!(matches!(Autoencoder::load(&path, Device::Cpu), Err(Error::File { .. })));
        // A file whose tensor has the wrong shape names that tensor.
        let mut small = Autoencoder::init(3, Device::Cpu)?;
        small.layers[1] =
            Linear::from_tensors(Tensor::zeros((3, 3), DType::F32, Device::Cpu)?, small.layers[1].bias.clone());
        small.save(&path)?;
        let e = Autoencoder::load(&path, Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("2.weight") && e.contains("[3, 3]"), "{e}");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
