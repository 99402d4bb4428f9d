//! Progress output of the trainer: an indicatif bar on a terminal, one plain line per logged step
//! otherwise, and optionally a JSON-lines file. Each logged step costs one host read (the mean loss
//! of the window, summed on the device).

use super::TrainerConfig;
use ferrograd_core::cuda::{memory::DeviceMemoryStatus, CudaDevice};
use ferrograd_core::{DType, Device, Result, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, IsTerminal, Write};
use std::time::Instant;

/// How the trainer reports progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// A bar when stdout is a terminal, lines otherwise.
    #[default]
    Auto,
    /// An indicatif progress bar.
    Bar,
    /// One line per logged step.
    Lines,
    /// Nothing on stdout (the JSON log, if any, is still written).
    Quiet,
}

enum Output {
    Bar(ProgressBar),
    Lines,
    Quiet,
}

pub(super) struct StepLog {
    out: Output,
    json: Option<BufWriter<File>>,
    window_loss: Option<Tensor>,
    window_steps: u64,
    window_samples: usize,
    window_start: Instant,
    start: Instant,
    last_samples: usize,
    device: Device,
}

fn human_bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Bytes the caching allocator has handed out on the training device (None on the CPU).
fn device_memory(device: Device) -> Option<usize> {
    let Device::Cuda(o) = device else { return None };
    let dev = CudaDevice::get(o).ok()?;
    DeviceMemoryStatus::of(&dev).ok().map(|s| s.allocator.allocated_bytes.current)
}

impl StepLog {
    pub(super) fn new(cfg: &TrainerConfig, device: Device) -> Result<StepLog> {
        let out = match cfg.progress {
            ProgressMode::Auto if std::io::stdout().is_terminal() => Output::Bar(Self::bar(cfg.max_steps)),
            ProgressMode::Bar => Output::Bar(Self::bar(cfg.max_steps)),
            ProgressMode::Auto | ProgressMode::Lines => Output::Lines,
            ProgressMode::Quiet => Output::Quiet,
        };
        let json = match &cfg.json_log {
            Some(p) => Some(BufWriter::new(OpenOptions::new().create(true).append(true).open(p).map_err(|e| {
                ferrograd_core::Error::File { path: p.display().to_string(), msg: format!("opening the JSON log: {e}") }
            })?)),
            None => None,
        };
        let now = Instant::now();
        Ok(StepLog {
            out,
            json,
            window_loss: None,
            window_steps: 0,
            window_samples: 0,
            window_start: now,
            start: now,
            last_samples: 0,
            device,
        })
    }

    fn bar(total: u64) -> ProgressBar {
        let bar = ProgressBar::new(total);
        // The template is a constant known to parse; fall back to the default style if not.
        if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
        {
            bar.set_style(style);
        }
        bar
    }

    pub(super) fn last_samples(&self) -> usize {
        self.last_samples
    }

    /// Record a step; on logging steps read the window's mean loss and report it.
    pub(super) fn on_step(
        &mut self,
        step: u64,
        loss: &Tensor,
        samples: usize,
        lr: f64,
        cfg: &TrainerConfig,
    ) -> Result<Option<f64>> {
        let l = loss.detach().to_dtype(DType::F32)?;
        self.window_loss = Some(match self.window_loss.take() {
            Some(s) => s.add(&l)?,
            None => l,
        });
        self.window_steps += 1;
        self.window_samples += samples;
        self.last_samples = samples;
        if let Output::Bar(b) = &self.out {
            b.set_position(step);
        }
        if !(step.is_multiple_of(cfg.log_every) || step == cfg.max_steps) {
            return Ok(None);
        }
        let sum = match self.window_loss.take() {
            Some(s) => s.item_f64()?,
            None => return Ok(None),
        };
        let mean = sum / self.window_steps as f64;
        let secs = self.window_start.elapsed().as_secs_f64();
        let rate = if secs > 0.0 { self.window_samples as f64 / secs } else { 0.0 };
        let mem = device_memory(self.device);
        let mem_txt = mem.map(|m| format!(" | mem {}", human_bytes(m))).unwrap_or_default();
        match &self.out {
            Output::Bar(b) => b.set_message(format!("loss {mean:.4} | lr {lr:.2e} | {rate:.0} samples/s{mem_txt}")),
            Output::Lines => {
                println!("step {step}/{} loss {mean:.6} lr {lr:.3e} {rate:.0} samples/s{mem_txt}", cfg.max_steps)
            }
            Output::Quiet => {}
        }
        if let Some(j) = self.json.as_mut() {
            let line = serde_json::json!({
                "step": step,
                "loss": mean,
                "lr": lr,
                "samples_per_sec": rate,
                "elapsed_s": self.start.elapsed().as_secs_f64(),
                "device_mem_bytes": mem,
            });
            writeln!(j, "{line}").and_then(|_| j.flush()).map_err(|e| ferrograd_core::Error::File {
                path: cfg.json_log.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
                msg: format!("writing the JSON log: {e}"),
            })?;
        }
        self.window_steps = 0;
        self.window_samples = 0;
        self.window_start = Instant::now();
        Ok(Some(mean))
    }

    pub(super) fn finish(&mut self) {
        if let Output::Bar(b) = &self.out {
            b.finish();
        }
        if let Some(j) = self.json.as_mut() {
            // Each line was flushed when written; this only matters if a flush failed silently.
            let _ = j.flush();
        }
    }
}
