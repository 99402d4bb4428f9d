//! The training step behind [`super::train::run`], three ways (the `Stepper` trait): the fused
//! CUDA step (`fused::FusedTrainer`), the autograd step eager on any device (`Autograd`), and the
//! autograd step captured once as a CUDA graph per batch shape and replayed (`GraphSteps`).

use super::dp::Reduce;
use super::model::Autoencoder;
use ferrograd_core::cuda::{Capture, CudaDevice, Graph};
use ferrograd_core::optim::{adam_step, adam_step_counted, AdamConfig};
use ferrograd_core::{DType, Device, Error, Result, Tensor};

/// One optimizer step over a batch, and the loss it saw.
pub(crate) trait Stepper {
    fn step(&mut self, x: &Tensor) -> Result<()>;
    fn loss(&self) -> Result<Tensor>;
    /// Leave the trained weights in the model's tensors (nothing to do for a stepper that trains
    /// those tensors in place).
    fn finish(&self, _model: &Autoencoder) -> Result<()> {
        Ok(())
    }
    /// The tensors a step updates in place and the step count (to undo steps: `Snapshot`).
    fn state(&self) -> (Vec<Tensor>, u64);
    fn set_step_count(&mut self, step: u64);
}

impl Stepper for super::fused::FusedTrainer {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        super::fused::FusedTrainer::step(self, x)
    }
    fn loss(&self) -> Result<Tensor> {
        Ok(super::fused::FusedTrainer::loss(self).clone())
    }
    fn finish(&self, model: &Autoencoder) -> Result<()> {
        self.write_back(model)
    }
    fn state(&self) -> (Vec<Tensor>, u64) {
        super::fused::FusedTrainer::state(self)
    }
    fn set_step_count(&mut self, step: u64) {
        super::fused::FusedTrainer::set_step_count(self, step)
    }
}

/// The generic path: autograd over the model's ops, then the fused multi-tensor Adam (with the
/// gradients averaged over ranks first when data parallel).
pub(super) struct Autograd {
    model: Autoencoder,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    adam: AdamConfig,
    step: u64,
    last: Option<Tensor>,
    reduce: Option<Reduce>,
}

impl Autograd {
    pub(super) fn new(model: &Autoencoder, adam: AdamConfig, reduce: Option<Reduce>) -> Result<Autograd> {
        let params = model.parameters();
        let m = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let v = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        Ok(Autograd { model: model.clone(), params, m, v, adam, step: 0, last: None, reduce })
    }
}

impl Stepper for Autograd {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        let loss = self.model.loss(x)?;
        let grads = loss.backward()?;
        let mut g: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| grads.get(p).cloned().ok_or_else(|| Error::Backward("a weight got no gradient".into())))
            .collect::<Result<_>>()?;
        let mut loss = loss.detach();
        if let Some(reduce) = &self.reduce {
            // The loss travels with the gradients, so every rank reads the same (mean) loss and
            // takes the same non-finite decision (`Guard`), as in `FusedTrainer::step_reduced`.
            let mut flat = g.iter().map(|t| t.flatten_all()).collect::<Result<Vec<_>>>()?;
            flat.push(loss.reshape(1)?);
            let flat = Tensor::cat(&flat, 0)?;
            reduce(&flat)?;
            let mut off = 0;
            for (t, p) in g.iter_mut().zip(&self.params) {
                *t = flat.narrow(0, off, p.elem_count())?.reshape(p.dims())?;
                off += p.elem_count();
            }
            loss = flat.narrow(0, off, 1)?.reshape(())?;
        }
        self.step += 1;
        adam_step(&self.params, &g, &self.m, &self.v, &self.adam, self.step)?;
        self.last = Some(loss);
        Ok(())
    }
    fn loss(&self) -> Result<Tensor> {
        self.last.clone().ok_or_else(|| Error::InvalidArgument("no step taken yet".into()))
    }
    fn state(&self) -> (Vec<Tensor>, u64) {
        (self.params.iter().chain(&self.m).chain(&self.v).cloned().collect(), self.step)
    }
    fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }
}

/// Warm-up steps before the capture (PyTorch's twin takes three too); they train like any step.
const WARMUP_STEPS: usize = 3;

/// The autograd step captured as a CUDA graph, one graph per batch length (the last batch of a
/// copy is shorter when `--batch` does not divide 5041).
pub(super) struct GraphSteps {
    model: Autoencoder,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Adam's step count, on the device.
    step: Tensor,
    adam: AdamConfig,
    shapes: Vec<ShapeGraph>,
    last: Option<Tensor>,
}

/// What one batch length needs: its fixed input, its capture (side stream and private pool), and
/// once warmed up, the graph and the loss tensor each replay overwrites.
struct ShapeGraph {
    input: Tensor,
    capture: Capture,
    warmups: usize,
    graph: Option<(Graph, Tensor)>,
}

impl GraphSteps {
    pub(super) fn new(model: &Autoencoder, adam: AdamConfig) -> Result<GraphSteps> {
        let params = model.parameters();
        let device = params.first().map_or(Device::Cpu, |p| p.device());
        let m = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let v = params.iter().map(|p| p.zeros_like()).collect::<Result<_>>()?;
        let step = Tensor::zeros(1, DType::F64, device)?;
        Ok(GraphSteps { model: model.clone(), params, m, v, step, adam, shapes: Vec::new(), last: None })
    }
}

/// Forward, backward and Adam on the fixed input: what is warmed up and captured.
fn autograd_step(
    model: &Autoencoder,
    params: &[Tensor],
    m: &[Tensor],
    v: &[Tensor],
    adam: &AdamConfig,
    step: &Tensor,
    x: &Tensor,
) -> Result<Tensor> {
    let loss = model.loss(x)?;
    let grads = loss.backward()?;
    let g: Vec<Tensor> = params
        .iter()
        .map(|p| grads.get(p).cloned().ok_or_else(|| Error::Backward("a weight got no gradient".into())))
        .collect::<Result<_>>()?;
    adam_step_counted(params, &g, m, v, adam, step)?;
    Ok(loss.detach())
}

impl Stepper for GraphSteps {
    fn step(&mut self, x: &Tensor) -> Result<()> {
        let i = match self.shapes.iter().position(|s| s.input.dims() == x.dims()) {
            Some(i) => i,
            None => {
                let Device::Cuda(o) = x.device() else {
                    return Err(Error::InvalidArgument("CUDA graphs need a CUDA device".into()));
                };
                let capture = Capture::new(&CudaDevice::get(o)?)?;
                self.shapes.push(ShapeGraph { input: x.zeros_like()?, capture, warmups: 0, graph: None });
                self.shapes.len() - 1
            }
        };
        let GraphSteps { model, params, m, v, step, adam, shapes, last } = self;
        let s = &mut shapes[i];
        s.input.set(x)?;
        let input = &s.input;
        let run = || autograd_step(model, params, m, v, adam, step, input);
        if s.warmups < WARMUP_STEPS {
            // The first warm-up creates the step's cuBLASLt plans: time their candidates then,
            // as the graph will replay whichever algorithm each plan holds thousands of times.
            let _tune = ferrograd_core::cuda::blaslt::tune_new_plans();
            *last = Some(s.capture.warmup(run)?);
            s.warmups += 1;
            return Ok(());
        }
        if s.graph.is_none() {
            s.graph = Some(s.capture.capture(run)?);
        }
        if let Some((graph, loss)) = &s.graph {
            graph.replay()?;
            *last = Some(loss.clone());
        }
        Ok(())
    }
    fn loss(&self) -> Result<Tensor> {
        self.last.clone().ok_or_else(|| Error::InvalidArgument("no step taken yet".into()))
    }
    /// Adam's step count lives on the device: it is among the tensors (restored in place with the
    /// weights and moments, so the captured graphs keep their addresses), and the host count is 0.
    fn state(&self) -> (Vec<Tensor>, u64) {
        let tensors = self.params.iter().chain(&self.m).chain(&self.v).chain(std::iter::once(&self.step));
        (tensors.cloned().collect(), 0)
    }
    fn set_step_count(&mut self, _step: u64) {}
}
