//! Observers with PyTorch's semantics (`torch.ao.quantization.MinMaxObserver`,
//! `MovingAverageMinMaxObserver` and their per-channel twins): a running minimum and maximum of
//! what they see, and the scale and zero point for a range `[qmin, qmax]` computed from them:
//!
//! ```text
//! min_neg = min(min, 0), max_pos = max(max, 0)
//! symmetric: scale = max(max(-min_neg, max_pos) / ((qmax - qmin) / 2), eps), zero_point = 0
//! affine:    scale = max((max_pos - min_neg) / (qmax - qmin), eps), zero_point = qmin - min_neg / scale
//! ```
//!
//! (eps = f32::EPSILON.) Everything stays on the tensors' device as tensor ops: observing never
//! reads back to the host, so a QAT step can be captured as a CUDA graph. The affine zero point is
//! returned unrounded; `fake_quantize` rounds it half to even and clamps it where PyTorch rounds
//! `min_neg / scale` first (the two differ only when `min_neg / scale` is exactly a half).

use ferrograd_core::{shape_err, DType, Error, Result, Tensor};

/// How the range maps to integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QScheme {
    /// Zero point 0, scale from the larger of |min| and |max| (weights; what int8 GEMMs need).
    Symmetric,
    /// Scale and zero point covering `[min, max]` (activations after a ReLU, say).
    Affine,
}

/// How the running range follows new batches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ObserverKind {
    /// The minimum and maximum of everything seen.
    MinMax,
    /// `min += c * (batch_min - min)` (the same for max), starting from the first batch's range
    /// (PyTorch's averaging constant defaults to 0.01).
    MovingAverage(f64),
}

/// A scale and zero point (f32 tensors of shape `[C]`, `C = 1` per tensor), ready for
/// `Tensor::fake_quantize`.
#[derive(Clone, Debug)]
pub struct QParams {
    /// The quantization step, `[C]`.
    pub scale: Tensor,
    /// The integer that 0 maps to, `[C]` (f32, rounded by the kernel).
    pub zero_point: Tensor,
}

/// A running range per tensor (`axis: None`) or per channel along `axis`.
#[derive(Clone, Debug)]
pub struct Observer {
    /// How the range is tracked (min-max or moving average).
    pub kind: ObserverKind,
    /// Symmetric or affine.
    pub scheme: QScheme,
    /// The smallest quantized integer.
    pub qmin: i32,
    /// The largest quantized integer.
    pub qmax: i32,
    /// The channel dim (`None`: one range for the tensor).
    pub axis: Option<usize>,
    /// f32 `[C]`, `None` before the first batch.
    min: Option<Tensor>,
    max: Option<Tensor>,
}

impl Observer {
    /// An observer that has seen nothing yet; `Error::InvalidArgument` unless `qmin < qmax`.
    pub fn new(kind: ObserverKind, scheme: QScheme, qmin: i32, qmax: i32, axis: Option<usize>) -> Result<Observer> {
        if qmin >= qmax {
            return Err(Error::InvalidArgument(format!("observer: qmin {qmin} must be below qmax {qmax}")));
        }
        if let ObserverKind::MovingAverage(c) = kind {
            if !(0.0..=1.0).contains(&c) {
                return Err(Error::InvalidArgument(format!("observer: averaging constant {c} outside [0, 1]")));
            }
        }
        Ok(Observer { kind, scheme, qmin, qmax, axis, min: None, max: None })
    }

    /// Per-channel symmetric int8 on `[-127, 127]` along `axis` (weights; the range int8
    /// inference uses, so that QAT and inference quantize alike).
    pub fn weight_int8(axis: usize) -> Observer {
        Observer {
            kind: ObserverKind::MinMax,
            scheme: QScheme::Symmetric,
            qmin: -127,
            qmax: 127,
            axis: Some(axis),
            min: None,
            max: None,
        }
    }

    /// Per-tensor symmetric int8 on `[-127, 127]`, moving average 0.01 (activations).
    pub fn activation_int8() -> Observer {
        Observer {
            kind: ObserverKind::MovingAverage(0.01),
            scheme: QScheme::Symmetric,
            qmin: -127,
            qmax: 127,
            axis: None,
            min: None,
            max: None,
        }
    }

    /// The running `(min, max)`, f32 `[C]`, once something was observed.
    pub fn range(&self) -> Option<(&Tensor, &Tensor)> {
        self.min.as_ref().zip(self.max.as_ref())
    }

    /// Fold `x`'s range into the running one (no gradient flows; nothing is read to the host).
    pub fn observe(&mut self, x: &Tensor) -> Result<()> {
        x.dtype().check_float("observer")?;
        // Detached: the running range records no graph and keeps no activations alive.
        let x = x.detach().to_dtype(DType::F32)?;
        let (lo, hi) = (|| -> Result<(Tensor, Tensor)> {
            let reduce: Vec<usize> = match self.axis {
                None => (0..x.rank()).collect(),
                Some(a) if a < x.rank() => (0..x.rank()).filter(|&d| d != a).collect(),
                Some(a) => return Err(shape_err!("observer", "axis {a} out of range for shape {:?}", x.dims())),
            };
            let flat = |t: Tensor| -> Result<Tensor> {
                let n = t.elem_count();
                t.reshape(n)
            };
            if x.elem_count() == 0 {
                return Err(shape_err!("observer", "cannot observe an empty tensor of shape {:?}", x.dims()));
            }
            if reduce.is_empty() {
                return Ok((flat(x.clone())?, flat(x.clone())?));
            }
            Ok((flat(x.min(reduce.clone(), false)?)?, flat(x.max(reduce, false)?)?))
        })()?;
        if let Some((m, _)) = self.range() {
            if m.dims() != lo.dims() {
                return Err(shape_err!(
                    "observer",
                    "{} channels observed before, {} now",
                    m.elem_count(),
                    lo.elem_count()
                ));
            }
        }
        let (min, max) = match (self.kind, self.min.take(), self.max.take()) {
            (_, None, _) | (_, _, None) => (lo, hi),
            (ObserverKind::MinMax, Some(m), Some(n)) => (m.minimum(&lo)?, n.maximum(&hi)?),
            (ObserverKind::MovingAverage(c), Some(m), Some(n)) => {
                (m.add(&lo.sub(&m)?.mul_scalar(c)?)?, n.add(&hi.sub(&n)?.mul_scalar(c)?)?)
            }
        };
        self.min = Some(min);
        self.max = Some(max);
        Ok(())
    }

    /// The scale and zero point of the running range (module documentation); an error before the
    /// first [`observe`](Self::observe).
    pub fn qparams(&self) -> Result<QParams> {
        let (min, max) = self.range().ok_or_else(|| Error::InvalidArgument("observer: nothing observed yet".into()))?;
        let zero = Tensor::zeros(min.shape().clone(), DType::F32, min.device())?;
        let eps = zero.add_scalar(f32::EPSILON as f64)?;
        let (min_neg, max_pos) = (min.minimum(&zero)?, max.maximum(&zero)?);
        let (qmin, qmax) = (self.qmin as f64, self.qmax as f64);
        Ok(match self.scheme {
            QScheme::Symmetric => {
                let scale = min_neg.neg()?.maximum(&max_pos)?.mul_scalar(2.0 / (qmax - qmin))?.maximum(&eps)?;
                QParams { scale, zero_point: zero }
            }
            QScheme::Affine => {
                let scale = max_pos.sub(&min_neg)?.mul_scalar(1.0 / (qmax - qmin))?.maximum(&eps)?;
                let zero_point = min_neg.div(&scale)?.affine(-1.0, qmin)?;
                QParams { scale, zero_point }
            }
        })
    }
}
