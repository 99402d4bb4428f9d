//! The Mamba block (Gu & Dao 2023), `mamba_ssm.modules.mamba_simple.Mamba` with its parameter
//! names, layouts and initialisation: in-projection to `x` and the gate `z`, causal depthwise
//! conv1d and SiLU on `x`, `x_proj` to (dt, B, C), `dt_proj`, the selective scan with `D` and the
//! `z` gate (`ferrograd_core::fused::selective_scan`), out-projection. The conv and the scan are
//! fused ops with their own backward (`fused/conv1d_causal`, `fused/selective_scan`).
//!
//! [`Mamba::step`] is the recurrent decode of one token: the last `d_conv` inputs of the conv and
//! the `[d_inner, d_state]` scan state are carried in a [`MambaState`] between calls (mamba_ssm's
//! `Mamba.step`), so generating a token costs the same at any position.

use crate::module::join_name;
use crate::{init, Linear, Module};
use ferrograd_core::fused::selective_scan::{selective_scan, ScanArgs};
use ferrograd_core::{shape_err, DType, Device, Error, Result, Rng, Tensor};

/// `Mamba(d_model, d_state, d_conv, expand, dt_rank="auto", dt_min, dt_max, dt_init="random",
/// dt_scale, dt_init_floor, conv_bias, bias)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MambaConfig {
    /// Model width (the block's input and output features).
    pub d_model: usize,
    /// SSM state size per channel (16).
    pub d_state: usize,
    /// Causal conv1d width (4).
    pub d_conv: usize,
    /// Inner width factor: `d_inner = expand * d_model` (2).
    pub expand: usize,
    /// `None`: `ceil(d_model / 16)` (mamba_ssm's "auto").
    pub dt_rank: Option<usize>,
    /// Smallest initial step size (dt is drawn log-uniformly in `[dt_min, dt_max]`).
    pub dt_min: f64,
    /// Largest initial step size.
    pub dt_max: f64,
    /// Scale of `dt_proj`'s initial weights.
    pub dt_scale: f64,
    /// Initial dt values are clamped to at least this.
    pub dt_init_floor: f64,
    /// Whether the conv has a bias.
    pub conv_bias: bool,
    /// Biases of the in- and out-projections.
    pub bias: bool,
}

impl MambaConfig {
    /// mamba_ssm's defaults (d_state 16, d_conv 4, expand 2) for a model width.
    pub fn new(d_model: usize) -> MambaConfig {
        MambaConfig {
            d_model,
            d_state: 16,
            d_conv: 4,
            expand: 2,
            dt_rank: None,
            dt_min: 0.001,
            dt_max: 0.1,
            dt_scale: 1.0,
            dt_init_floor: 1e-4,
            conv_bias: true,
            bias: false,
        }
    }

    /// `expand * d_model`.
    pub fn d_inner(&self) -> usize {
        self.expand * self.d_model
    }

    /// The rank of dt's projection (`dt_rank`, or `ceil(d_model / 16)`).
    pub fn dt_rank(&self) -> usize {
        self.dt_rank.unwrap_or(self.d_model.div_ceil(16))
    }

    /// `Error::InvalidArgument` for a zero size or an invalid dt range.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 || self.d_state == 0 || self.d_conv == 0 || self.expand == 0 || self.dt_rank() == 0 {
            return Err(Error::InvalidArgument(format!("mamba: every size must be positive, got {self:?}")));
        }
        if !(self.dt_min > 0.0 && self.dt_max >= self.dt_min && self.dt_init_floor >= 0.0) {
            return Err(Error::InvalidArgument(format!("mamba: need 0 < dt_min <= dt_max, got {self:?}")));
        }
        Ok(())
    }
}

/// The carried state of [`Mamba::step`]: `conv` `[batch, d_inner, d_conv]` (the last `d_conv`
/// conv inputs, oldest first) and `ssm` `[batch, d_inner, d_state]`.
#[derive(Debug, Clone)]
pub struct MambaState {
    /// The last `d_conv` conv inputs.
    pub conv: Tensor,
    /// The scan's state.
    pub ssm: Tensor,
}

/// mamba_ssm's `Mamba` block (see the module documentation); parameters named as there.
#[derive(Debug, Clone)]
pub struct Mamba {
    /// The sizes it was built with.
    pub config: MambaConfig,
    /// `[2 d_inner, d_model]`: x then z.
    pub in_proj: Linear,
    /// `[d_inner, d_conv]` (PyTorch's Conv1d weight `[d_inner, 1, d_conv]` without the middle dim).
    pub conv_weight: Tensor,
    /// `[d_inner]`, where the config asks for it.
    pub conv_bias: Option<Tensor>,
    /// `[dt_rank + 2 d_state, d_inner]`, no bias.
    pub x_proj: Linear,
    /// `[d_inner, dt_rank]`; its bias is the scan's `delta_bias`.
    pub dt_proj: Linear,
    /// `[d_inner, d_state]`: `A = -exp(A_log)`.
    pub a_log: Tensor,
    /// `[d_inner]`
    pub d: Tensor,
    /// `[d_model, d_inner]`
    pub out_proj: Linear,
}

impl Mamba {
    /// mamba_ssm's initialisation: Linear and Conv1d layers as PyTorch's defaults (kaiming
    /// uniform, a = sqrt(5)); `dt_proj.weight` uniform in `±dt_rank^-0.5 * dt_scale`; `dt_proj.bias`
    /// the inverse softplus of `dt` log-uniform in `[dt_min, dt_max]` (floored at `dt_init_floor`);
    /// `A_log[d, n] = log(n + 1)` (S4D-real); `D = 1`.
    pub fn new(config: MambaConfig, rng: &mut Rng, device: Device) -> Result<Mamba> {
        config.validate()?;
        let (dm, di, n, k, r) = (config.d_model, config.d_inner(), config.d_state, config.d_conv, config.dt_rank());
        let in_proj = Linear::new(dm, 2 * di, config.bias, rng, device)?;
        // Conv1d(di, di, k, groups=di): fan_in = k.
        let conv_weight = init::kaiming_uniform(rng, 5f64.sqrt(), k, (di, k), device)?;
        let conv_bias =
            if config.conv_bias { Some(init::uniform(rng, 1.0 / (k as f64).sqrt(), di, device)?) } else { None };
        let x_proj = Linear::new(di, r + 2 * n, false, rng, device)?;
        let std = (r as f64).powf(-0.5) * config.dt_scale;
        let dt_w = init::uniform(rng, std, (di, r), device)?;
        // dt = exp(U(0, 1) (log dt_max - log dt_min) + log dt_min), floored; bias = dt + log(-expm1(-dt)).
        let (lo, hi) = (config.dt_min.ln(), config.dt_max.ln());
        let u = Tensor::rand_with(rng, 0.0, 1.0, di, DType::F64, Device::Cpu)?.to_f64_vec()?;
        let inv: Vec<f32> = u
            .iter()
            .map(|u| {
                let dt = (u * (hi - lo) + lo).exp().max(config.dt_init_floor);
                (dt + (-(-dt).exp_m1()).ln()) as f32
            })
            .collect();
        let dt_b = Tensor::from_vec(inv, di, Device::Cpu)?.to_device(device)?.requires_grad();
        let dt_proj = Linear::from_tensors(dt_w, Some(dt_b));
        let a: Vec<f32> = (0..di).flat_map(|_| (1..=n).map(|v| (v as f32).ln())).collect();
        let a_log = Tensor::from_vec(a, (di, n), Device::Cpu)?.to_device(device)?.requires_grad();
        let d = init::constant(1.0, di, device)?;
        let out_proj = Linear::new(di, dm, config.bias, rng, device)?;
        Ok(Mamba { config, in_proj, conv_weight, conv_bias, x_proj, dt_proj, a_log, d, out_proj })
    }

    /// The same block with every parameter cast to `dtype` (new leaf variables): f64 for checks.
    pub fn to_dtype(&self, dtype: DType) -> Result<Mamba> {
        let c = |t: &Tensor| -> Result<Tensor> { Ok(t.detach().to_dtype(dtype)?.requires_grad()) };
        let lin = |l: &Linear| -> Result<Linear> {
            Ok(Linear { weight: c(&l.weight)?, bias: l.bias.as_ref().map(c).transpose()? })
        };
        Ok(Mamba {
            config: self.config,
            in_proj: lin(&self.in_proj)?,
            conv_weight: c(&self.conv_weight)?,
            conv_bias: self.conv_bias.as_ref().map(c).transpose()?,
            x_proj: lin(&self.x_proj)?,
            dt_proj: lin(&self.dt_proj)?,
            a_log: c(&self.a_log)?,
            d: c(&self.d)?,
            out_proj: lin(&self.out_proj)?,
        })
    }

    fn check_input(&self, x: &Tensor, rank: usize, what: &'static str) -> Result<()> {
        let dm = self.config.d_model;
        if x.rank() != rank || x.dims().last() != Some(&dm) {
            let want = if rank == 3 { "[batch, len, d_model]" } else { "[batch, d_model]" };
            return Err(shape_err!(what, "input must be {want} with d_model {dm}, got {:?}", x.dims()));
        }
        if !x.dtype().is_float() {
            return Err(Error::UnsupportedDType { op: what, dtype: x.dtype() });
        }
        Ok(())
    }

    /// The conv parameters in the activations' dtype (a differentiable cast when it differs).
    fn conv_params(&self, dtype: DType) -> Result<(Tensor, Option<Tensor>)> {
        let cast = |t: &Tensor| if t.dtype() == dtype { Ok(t.clone()) } else { t.to_dtype(dtype) };
        Ok((cast(&self.conv_weight)?, self.conv_bias.as_ref().map(cast).transpose()?))
    }

    /// `A = -exp(A_log)`, `[d_inner, d_state]`.
    fn a(&self) -> Result<Tensor> {
        self.a_log.exp()?.neg()
    }

    /// The full-sequence forward of `x` `[batch, len, d_model]` (mamba_ssm's slow path, with the
    /// fused conv and scan): `[batch, len, d_model]`.
    pub fn forward_seq(&self, x: &Tensor) -> Result<Tensor> {
        self.check_input(x, 3, "mamba")?;
        let cfg = &self.config;
        let (di, n, r) = (cfg.d_inner(), cfg.d_state, cfg.dt_rank());
        let xz = self.in_proj.forward(x)?; // [B, L, 2 di]
        let dtype = xz.dtype();
        // [B, di, L] views of the projection (the fused ops read strided inputs).
        let xs = xz.narrow(2, 0, di)?.permute(&[0, 2, 1])?;
        let z = xz.narrow(2, di, di)?.permute(&[0, 2, 1])?;
        let (cw, cb) = self.conv_params(dtype)?;
        let xc = xs.conv1d_causal(&cw, cb.as_ref())?.silu()?; // [B, di, L]
        let xl = xc.permute(&[0, 2, 1])?; // [B, L, di]
        let dbl = self.x_proj.forward(&xl)?; // [B, L, r + 2n]
        let dt = dbl.narrow(2, 0, r)?;
        let dt = Linear { weight: self.dt_proj.weight.clone(), bias: None }.forward(&dt)?; // [B, L, di]
        let dt = dt.permute(&[0, 2, 1])?;
        let bm = dbl.narrow(2, r, n)?.permute(&[0, 2, 1])?.unsqueeze(1)?; // [B, 1, n, L]
        let cm = dbl.narrow(2, r + n, n)?.permute(&[0, 2, 1])?.unsqueeze(1)?;
        let a = self.a()?;
        let bias = self.dt_proj.bias.as_ref();
        let y = selective_scan(
            &xc,
            &dt.to_dtype(xc.dtype())?,
            &a,
            &bm.to_dtype(xc.dtype())?,
            &cm.to_dtype(xc.dtype())?,
            ScanArgs { d: Some(&self.d), z: Some(&z.to_dtype(xc.dtype())?), delta_bias: bias, delta_softplus: true },
        )?; // [B, di, L]
        self.out_proj.forward(&y.permute(&[0, 2, 1])?)
    }

    /// A zero state for `batch` sequences, on the block's device, in `dtype`.
    pub fn zero_state(&self, batch: usize, dtype: DType) -> Result<MambaState> {
        let (di, k, n) = (self.config.d_inner(), self.config.d_conv, self.config.d_state);
        let dev = self.a_log.device();
        Ok(MambaState {
            conv: Tensor::zeros((batch, di, k), dtype, dev)?,
            ssm: Tensor::zeros((batch, di, n), dtype, dev)?,
        })
    }

    /// One step of the recurrence (mamba_ssm's `Mamba.step`): `x` `[batch, d_model]` is the next
    /// token's input; `state` (from [`Mamba::zero_state`] or the previous step) is advanced in
    /// place of its tensors. Returns `[batch, d_model]`, what [`Mamba::forward_seq`] gives at
    /// this position.
    pub fn step(&self, x: &Tensor, state: &mut MambaState) -> Result<Tensor> {
        self.check_input(x, 2, "mamba step")?;
        let cfg = &self.config;
        let (di, n, r, k) = (cfg.d_inner(), cfg.d_state, cfg.dt_rank(), cfg.d_conv);
        let batch = x.dims()[0];
        for (name, t, want) in [("conv", &state.conv, [batch, di, k]), ("ssm", &state.ssm, [batch, di, n])] {
            if t.dims() != want {
                return Err(shape_err!("mamba step", "the {name} state must be {want:?}, got {:?}", t.dims()));
            }
        }
        let xz = self.in_proj.forward(x)?; // [B, 2 di]
        let dtype = state.ssm.dtype();
        let xs = xz.narrow(1, 0, di)?.to_dtype(dtype)?;
        let z = xz.narrow(1, di, di)?.to_dtype(dtype)?;
        // Shift the conv window by one and append this input.
        let conv = Tensor::cat(&[state.conv.narrow(2, 1, k - 1)?, xs.unsqueeze(2)?], 2)?;
        let (cw, cb) = self.conv_params(dtype)?;
        let mut xc = conv.mul(&cw.unsqueeze(0)?)?.sum(2, false)?; // [B, di]
        if let Some(b) = cb {
            xc = xc.add(&b)?;
        }
        let xc = xc.silu()?;
        let dbl = self.x_proj.forward(&xc)?.to_dtype(dtype)?; // [B, r + 2n]
        let dt = Linear { weight: self.dt_proj.weight.clone(), bias: None }.forward(&dbl.narrow(1, 0, r)?)?;
        let dt = dt.to_dtype(dtype)?;
        let dt = match &self.dt_proj.bias {
            Some(b) => dt.add(&b.to_dtype(dtype)?)?,
            None => dt,
        };
        let dt = softplus(&dt)?; // [B, di]
        let bm = dbl.narrow(1, r, n)?; // [B, n]
        let cm = dbl.narrow(1, r + n, n)?;
        let a = self.a()?.to_dtype(dtype)?; // [di, n]
        let dt3 = dt.unsqueeze(2)?; // [B, di, 1]
        let da = dt3.mul(&a.unsqueeze(0)?)?.exp()?; // [B, di, n]
        let dbx = dt3.mul(&bm.unsqueeze(1)?)?.mul(&xc.unsqueeze(2)?)?;
        let ssm = state.ssm.mul(&da)?.add(&dbx)?;
        let y = ssm.mul(&cm.unsqueeze(1)?)?.sum(2, false)?; // [B, di]
        let y = y.add(&xc.mul(&self.d.to_dtype(dtype)?)?)?.mul(&z.silu()?)?;
        state.conv = conv;
        state.ssm = ssm;
        self.out_proj.forward(&y)
    }
}

/// `softplus(x) = max(x, 0) + log(1 + exp(-|x|))`: the same function as PyTorch's (whose
/// threshold 20 changes it by less than 3e-9) without overflow.
fn softplus(x: &Tensor) -> Result<Tensor> {
    x.relu()?.add(&x.abs()?.neg()?.exp()?.add_scalar(1.0)?.log()?)
}

impl Module for Mamba {
    /// [`Mamba::forward_seq`] of `[batch, len, d_model]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_seq(x)
    }

    /// mamba_ssm's state-dict names: `in_proj.weight`, `conv1d.weight` (ours `[d_inner, d_conv]`,
    /// theirs `[d_inner, 1, d_conv]`), `conv1d.bias`, `x_proj.weight`, `dt_proj.weight`,
    /// `dt_proj.bias`, `A_log`, `D`, `out_proj.weight`.
    fn visit_parameters(&self, prefix: &str, f: &mut dyn FnMut(String, &Tensor)) {
        self.in_proj.visit_parameters(&join_name(prefix, "in_proj"), f);
        f(join_name(prefix, "conv1d.weight"), &self.conv_weight);
        if let Some(b) = &self.conv_bias {
            f(join_name(prefix, "conv1d.bias"), b);
        }
        self.x_proj.visit_parameters(&join_name(prefix, "x_proj"), f);
        self.dt_proj.visit_parameters(&join_name(prefix, "dt_proj"), f);
        f(join_name(prefix, "A_log"), &self.a_log);
        f(join_name(prefix, "D"), &self.d);
        self.out_proj.visit_parameters(&join_name(prefix, "out_proj"), f);
    }
}
