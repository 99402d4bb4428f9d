//! Low-latency inference of a small model: [`Predictor`] runs a forward (any closure, such as a
//! module's `forward`) on a fixed input buffer, either eagerly or as a CUDA graph captured once and
//! replayed, with the input and output moving through page-locked host buffers: one call is an
//! async host-to-device copy, the graph launch (or the eager kernels), an async device-to-host copy
//! and one stream synchronize. What a policy network serving one request at a time (batch 1) or a
//! small batch (32) needs, and what PyTorch does with `torch.cuda.graphs` and pinned tensors.
//!
//! The graph replays on the addresses it was captured with, so the input lives in one device
//! buffer that each call overwrites and the output is the tensor the capture returned (the pool's
//! block, rewritten by each replay). The forward runs under `no_grad`.

use super::device::{driver_err, CudaDevice};
use super::graph::Graph;
use super::pinned::PinnedBuf;
use super::sync::host_wait;
use crate::{with_no_grad, DType, Device, Error, Result, Shape, Tensor};
use cudarc::driver::sys;
use std::sync::Arc;

/// How [`Predictor`] runs the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PredictMode {
    /// Every call launches the forward's kernels from the host (PyTorch eager).
    Eager,
    /// The forward is captured once as a CUDA graph (after two warm-up runs) and each call is one
    /// graph launch (PyTorch's `torch.cuda.CUDAGraph`).
    Graph,
}

/// A model's forward behind fixed, pinned f32 input and output buffers (see the module docs).
pub struct Predictor<F> {
    f: F,
    mode: PredictMode,
    /// `[batch, ..]` f32, on the device: the buffer every call fills.
    input: Tensor,
    /// The graph and the output tensor each replay rewrites (graph mode).
    graph: Option<(Graph, Tensor)>,
    out_shape: Shape,
    io: Option<PinnedIo>,
}

/// The page-locked staging buffers and the device they belong to.
struct PinnedIo {
    dev: Arc<CudaDevice>,
    host_in: PinnedBuf,
    host_out: PinnedBuf,
}

/// The forward's output as a contiguous f32 tensor.
fn run_forward<F: FnMut(&Tensor) -> Result<Tensor>>(f: &mut F, x: &Tensor) -> Result<Tensor> {
    with_no_grad(|| f(x)?.to_dtype(DType::F32)?.contiguous())
}

impl<F: FnMut(&Tensor) -> Result<Tensor>> Predictor<F> {
    /// A predictor of `f` for inputs of `input_shape` (f32) on `device`. Runs `f` (eager: once, to
    /// learn the output's shape; graph: twice, then captures it). On the CPU both modes run `f`
    /// eagerly. Errors: what `f` returns, `Error::GraphCapture` when `f` cannot be captured (it
    /// reads a value back to the host, or synchronizes).
    pub fn new(device: Device, input_shape: impl Into<Shape>, mode: PredictMode, mut f: F) -> Result<Predictor<F>> {
        let shape = input_shape.into();
        // Not zeros: a forward that special-cases zeros must not be what gets captured or timed.
        let input = Tensor::full(0.5, shape.clone(), DType::F32, device)?;
        let (graph, out_shape, io) = match device {
            Device::Cpu => (None, run_forward(&mut f, &input)?.shape().clone(), None),
            Device::Cuda(o) => {
                let dev = CudaDevice::get(o)?;
                let (graph, out) = match mode {
                    PredictMode::Eager => (None, run_forward(&mut f, &input)?),
                    PredictMode::Graph => {
                        let (g, out) = Graph::capture(&dev, 2, || run_forward(&mut f, &input))?;
                        (Some((g, out.clone())), out)
                    }
                };
                let host_in = PinnedBuf::new(&dev, shape.elem_count() * 4)?;
                let host_out = PinnedBuf::new(&dev, out.elem_count() * 4)?;
                (graph, out.shape().clone(), Some(PinnedIo { dev, host_in, host_out }))
            }
        };
        Ok(Predictor { f, mode, input, graph, out_shape, io })
    }

    /// Eager or CUDA-graph replay, as built.
    pub fn mode(&self) -> PredictMode {
        self.mode
    }

    /// The shape `predict` expects its input in.
    pub fn input_shape(&self) -> &Shape {
        self.input.shape()
    }

    /// The shape of what `predict` writes.
    pub fn output_shape(&self) -> &Shape {
        &self.out_shape
    }

    /// One forward of `x` (the input's elements, row-major) into `out` (the output's). Returns
    /// when `out` holds the result.
    pub fn predict(&mut self, x: &[f32], out: &mut [f32]) -> Result<()> {
        let (n_in, n_out) = (self.input.elem_count(), self.out_shape.elem_count());
        if x.len() != n_in || out.len() != n_out {
            return Err(Error::InvalidArgument(format!(
                "predict: {} inputs and room for {} outputs, the model takes {n_in} ({:?}) and gives {n_out} ({:?})",
                x.len(),
                out.len(),
                self.input.dims(),
                self.out_shape.dims()
            )));
        }
        let Some(io) = self.io.as_mut() else {
            let xin = Tensor::from_slice(x, self.input.shape().clone(), Device::Cpu)?;
            let y = run_forward(&mut self.f, &xin)?.to_vec::<f32>()?;
            out.copy_from_slice(&y);
            return Ok(());
        };
        let dev = io.dev.clone();
        dev.ctx.bind_to_thread().map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        for (d, v) in io.host_in.as_mut_slice(n_in * 4).chunks_exact_mut(4).zip(x) {
            d.copy_from_slice(&v.to_ne_bytes());
        }
        let stream = dev.current_cuda_stream().cu_stream();
        // SAFETY: `host_in` is page-locked and holds n_in f32; the input buffer is a contiguous f32
        // tensor of n_in elements; the copy is on the stream the forward runs on, which is
        // synchronized below before `host_in` is touched again.
        unsafe { sys::cuMemcpyHtoDAsync_v2(self.input.cuda_ptr()?, io.host_in.as_ptr() as *const _, n_in * 4, stream) }
            .result()
            .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))?;
        let y = match &self.graph {
            Some((g, y)) => {
                g.replay()?;
                y.clone()
            }
            None => run_forward(&mut self.f, &self.input)?,
        };
        let dst = io.host_out.as_mut_slice(n_out * 4).as_mut_ptr();
        // SAFETY: `host_out` is page-locked with room for n_out f32; `y` is a live contiguous f32
        // tensor of n_out elements (held until after the synchronize).
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut _, y.cuda_ptr()?, n_out * 4, stream) }
            .result()
            .map_err(|e| driver_err("cuMemcpyDtoHAsync", e))?;
        host_wait("cuStreamSynchronize", || {
            dev.current_cuda_stream().synchronize().map_err(|e| driver_err("cuStreamSynchronize", e))
        })?;
        drop(y);
        for (o, b) in out.iter_mut().zip(io.host_out.as_slice(n_out * 4).chunks_exact(4)) {
            *o = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}
