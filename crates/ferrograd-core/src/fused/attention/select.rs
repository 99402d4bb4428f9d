//! Which implementation runs attention on CUDA, and what ran.
//!
//! - `FERROGRAD_ATTENTION=flash`: our FlashAttention-2 style kernels (`cuda.rs`), always.
//! - `FERROGRAD_ATTENTION=cudnn`: cuDNN's fused SDPA (`cudnn/`) wherever it can run the case
//!   (cuDNN 9 found, bf16 / f16, no dropout, a head dim it takes, a plan it builds); our kernels
//!   for the rest, logged once. Forcing cannot make cuDNN run what it cannot.
//! - `FERROGRAD_ATTENTION=math`: the definition composed from primitive ops (matmul, scale,
//!   causal bias, softmax, matmul; autograd through them): it materialises the `Tq x Tk` scores,
//!   like PyTorch's "math" backend. A reference for debugging, not for speed; no dropout.
//! - unset (or `auto`): cuDNN where it can run the case and there is more than one query row,
//!   our kernels otherwise (a KV-cache decode step has one query and a new key length each token:
//!   cuDNN would build a plan for every step).
//! - anything else: every CUDA attention call fails with `Error::InvalidArgument` naming the value.
//!
//! The forward and the backward choose independently: both backends save the same statistics (the
//! natural-log log-sum-exp of each query row, f32 `[B, H, Tq]`) and each backward reads the saved
//! output and statistics of either forward. [`set_backend`] overrides the variable for the calling
//! thread (the bench's `--backend`, tests). The choice in force is printed once per process, on
//! the first CUDA call; [`counters_on_this_thread`] says what ran.
//!
//! Our kernels have a Hopper variant (`attention_wgmma.cu`: bf16 / f16, head dims 64 and 128, with
//! or without dropout), used on sm_90 devices unless `FERROGRAD_ATTENTION_WGMMA=0` (or [`set_wgmma`] on the
//! thread) keeps the mma.sync kernels, which run everywhere else.

use crate::{Error, Result};
use std::cell::Cell;
use std::sync::{Mutex, Once, OnceLock};

/// An attention implementation on CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// cuDNN where it can run the case, our kernels otherwise (the default).
    Auto,
    /// Our FlashAttention-2 style kernels.
    Flash,
    /// cuDNN's fused SDPA where it can run the case (our kernels otherwise).
    Cudnn,
    /// The composed definition (materialises the scores).
    Math,
}

impl Backend {
    /// Parse `FERROGRAD_ATTENTION`'s value: `auto` (or empty), `flash`, `cudnn`, `math`.
    pub fn parse(s: &str) -> Result<Backend> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Backend::Auto),
            "flash" => Ok(Backend::Flash),
            "cudnn" => Ok(Backend::Cudnn),
            "math" => Ok(Backend::Math),
            other => Err(Error::InvalidArgument(format!(
                "FERROGRAD_ATTENTION={other:?}: expected flash, cudnn, math or auto"
            ))),
        }
    }

    /// The name `parse` accepts.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Flash => "flash",
            Backend::Cudnn => "cudnn",
            Backend::Math => "math",
        }
    }
}

thread_local! {
    static OVERRIDE: Cell<Option<Backend>> = const { Cell::new(None) };
}

/// Use `backend` for attention calls made on this thread (`None`: back to `FERROGRAD_ATTENTION`).
pub fn set_backend(backend: Option<Backend>) {
    OVERRIDE.with(|o| o.set(backend));
}

fn from_env() -> Result<Backend> {
    static ENV: OnceLock<Result<Backend>> = OnceLock::new();
    match ENV.get_or_init(|| Backend::parse(&std::env::var("FERROGRAD_ATTENTION").unwrap_or_default())) {
        Ok(b) => Ok(*b),
        Err(e) => Err(Error::InvalidArgument(e.to_string().replace("invalid argument: ", ""))),
    }
}

/// The backend in force for a call on this thread.
pub fn backend() -> Result<Backend> {
    match OVERRIDE.with(|o| o.get()) {
        Some(b) => Ok(b),
        None => from_env(),
    }
}

thread_local! {
    static WGMMA: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Whether our kernels may use their Hopper (`wgmma`) variants for calls on this thread:
/// `Some(false)` keeps the mma.sync kernels (tests and benches compare the two on one GPU),
/// `None` follows `FERROGRAD_ATTENTION_WGMMA` (`0` turns them off; on by default).
pub fn set_wgmma(enabled: Option<bool>) {
    WGMMA.with(|w| w.set(enabled));
}

/// Whether a call on this thread may use the Hopper kernels (where the device and case allow).
pub(super) fn wgmma_allowed() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    let from_env = || *ENV.get_or_init(|| std::env::var("FERROGRAD_ATTENTION_WGMMA").map_or(true, |v| v.trim() != "0"));
    WGMMA.with(|w| w.get()).unwrap_or_else(from_env)
}

/// Print `msg` on stderr the first time `key` is seen in this process.
pub(super) fn log_once(key: &str, msg: impl FnOnce() -> String) {
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.iter().any(|k| k == key) {
        seen.push(key.to_string());
        eprintln!("ferrograd: attention: {}", msg());
    }
}

/// The one line saying which backend attention uses, printed on the first CUDA call.
pub(super) fn announce(backend: Backend) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let cudnn = match super::cudnn::library() {
            Ok(l) => format!("cuDNN {} ({})", l.version_string(), l.path),
            Err(e) => format!("no cuDNN ({e})"),
        };
        let what = match backend {
            Backend::Auto | Backend::Cudnn if super::cudnn::library().is_ok() => {
                "cuDNN's fused SDPA for bf16/f16 without dropout over more than one query, our kernels otherwise"
            }
            Backend::Auto | Backend::Cudnn => "our kernels (cuDNN is not available)",
            Backend::Flash => "our kernels",
            Backend::Math => "the composed definition (math)",
        };
        eprintln!("ferrograd: attention backend {}: {what}; {cudnn}", backend.as_str());
    });
}

/// How many forwards and backwards each implementation ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Forwards run by our kernels.
    pub flash_fwd: u64,
    /// Backwards run by our kernels.
    pub flash_bwd: u64,
    /// Forwards run by cuDNN.
    pub cudnn_fwd: u64,
    /// Backwards run by cuDNN.
    pub cudnn_bwd: u64,
    /// Calls run by the composed definition.
    pub math: u64,
    /// Calls that asked for cuDNN (auto or forced) and ran our kernels instead.
    pub cudnn_fallbacks: u64,
    /// Of `flash_fwd`, the forwards run by the Hopper (`wgmma`) kernels.
    pub wgmma_fwd: u64,
    /// Of `flash_bwd`, the backwards run by the Hopper (`wgmma`) kernels.
    pub wgmma_bwd: u64,
}

const ZERO: Counters = Counters {
    flash_fwd: 0,
    flash_bwd: 0,
    cudnn_fwd: 0,
    cudnn_bwd: 0,
    math: 0,
    cudnn_fallbacks: 0,
    wgmma_fwd: 0,
    wgmma_bwd: 0,
};
static COUNTERS: Mutex<Counters> = Mutex::new(ZERO);
thread_local! {
    static HERE: Cell<Counters> = const { Cell::new(ZERO) };
}

pub(super) fn count(f: impl Fn(&mut Counters)) {
    f(&mut COUNTERS.lock().unwrap_or_else(|e| e.into_inner()));
    HERE.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v)
    });
}

/// What ran in this process.
pub fn counters() -> Counters {
    *COUNTERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// What ran on the calling thread (what a test sharing its process with others can rely on).
pub fn counters_on_this_thread() -> Counters {
    HERE.with(|c| c.get())
}
