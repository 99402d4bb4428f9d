//! Launching kernels: the `launch!` macro every op uses, launch shapes sized by the device's own
//! SM count, and the function cache keyed by (module, kernel name).

use super::device::CudaDevice;
use super::nvrtc::Module;
use crate::{DType, Error, Result};
use cudarc::driver::LaunchConfig;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

// ---- launch shapes -------------------------------------------------------------------------------
//
// Grid-stride kernels fill the chip, no more: launching blocks that a grid-stride loop would cover
// costs more than it saves (measured 2.2 vs 3.7 TB/s on an H200). "The chip" is the device the
// launch runs on: each `CudaDevice` knows its own SM count.

/// Grid-stride launch over `n` elements: 256 threads a block, at most a full chip of resident blocks.
pub fn cfg_1d(dev: &CudaDevice, n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, dev.sm_count() * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The launch of the elementwise maps with a 16-byte vector path (`binary_*`, `unary_*`): as
/// [`cfg_1d`] for small `n`, but never fewer blocks than give each thread one unrolled iteration
/// (four vectors: 16 f32 elements, `fg_unrolled`). There the chip-sized grid's threads each
/// walked four streams a whole grid apart, and DRAM moved fewer bytes: relu f32 8192x8192 at
/// 3817 GB/s with 132 x 8 blocks against 4080 GB/s with n / 4096 blocks (H200, a standalone
/// harness of the two traversals, 2026-11-23; device copy 4193 GB/s). The measurement in the
/// comment above was of a one-element-a-thread grid, which this is not.
pub fn cfg_elementwise(dev: &CudaDevice, n: usize) -> LaunchConfig {
    let mut c = cfg_1d(dev, n);
    let full = n.div_ceil(256 * 16).min(i32::MAX as usize) as u32;
    c.grid_dim.0 = c.grid_dim.0.max(full);
    c
}

/// [`cfg_elementwise`] for `n` elements of `dtype` in the maps' (`unary_*`, `binary_*`) own
/// units: `per` 16-byte vectors a thread. Where every operand is contiguous and 16-byte aligned
/// (`vector`, the kernels' own test), a floating dtype takes the vector path, `16 / size`
/// elements a vector, so f16 / bf16 need half the threads f32 does (counting their elements as
/// f32's left each thread two vectors in the remainder loop, one load in flight: bf16 add / mul
/// at 0.97-0.98x of PyTorch's GB/s on an H200, call D). Otherwise, and for the integers, the
/// element count, for the scalar loops. `per` is what keeps four loads in flight a thread
/// (`fg_unrolled`'s 4- and 2-vector steps): 4 for a unary map, 2 for a binary one (two operands).
/// Measured on an H200, 8192 x 8192 beside PyTorch (BENCHMARKS.md, fifteenth session, X2):
/// binary add / mul f32 1.000-1.007x with 2 against 0.984-0.997x with 4, bf16 0.992-1.000x
/// against 0.967-0.988x; unary relu / sigmoid / x * 2 0.966-0.985x with 4, 0.90-0.96x with 2,
/// 0.95x with 8 (an 8-vector step), 0.71-0.80x with 1. Since the twentieth session those unary
/// maps run a kernel of their own with PyTorch's block tile (`unary_vec_*`, launched by
/// `ops/unary.rs`, not through here): inside `unary_*` that traversal had measured 0.91-0.99x
/// (sixteenth session), because it shared the kernel's 60 registers; alone it is 1.00-1.01x.
pub fn cfg_map(dev: &CudaDevice, n: usize, dtype: DType, vector: bool, per: usize) -> LaunchConfig {
    if !(vector && dtype.is_float()) {
        return cfg_elementwise(dev, n);
    }
    // `cfg_elementwise`'s unit is an f32 of a four-vector thread: 16 of them a thread.
    cfg_elementwise(dev, n.div_ceil(16 / dtype.size_in_bytes()) * 16 / per.clamp(1, 16))
}

/// One block per row (grid-stride over rows), threads chosen by the row length, at most one
/// resident wave of blocks.
pub fn cfg_rows(dev: &CudaDevice, rows: usize, cols: usize, shared_mem_bytes: u32) -> LaunchConfig {
    let threads = match cols {
        0..=64 => 32,
        65..=256 => 64,
        257..=1024 => 128,
        1025..=4096 => 256,
        4097..=16384 => 512,
        _ => 1024,
    };
    let resident = dev.sm_count() * (2048 / threads as usize);
    LaunchConfig { grid_dim: (rows.clamp(1, resident) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes }
}

/// Column sums of a `[rows, cols]` matrix without atomics: `units` column units (a column, or a
/// pack of columns) across the threads of grid.x (at most 256 a block), the rows split across grid.y
/// so that the chip fills; each block leaves one row of partial sums. Returns the config, the rows
/// per split and the number of splits (the partial rows a second kernel adds).
pub fn cfg_col_sums(dev: &CudaDevice, rows: usize, units: usize) -> (LaunchConfig, usize, usize) {
    let (rows, units) = (rows.max(1), units.max(1));
    let blocks_x = units.div_ceil(256);
    let threads = units.div_ceil(blocks_x).next_multiple_of(32).min(256);
    let splits = (dev.sm_count() * 8 / blocks_x).clamp(1, 65535).min(rows);
    let rps = rows.div_ceil(splits);
    let splits = rows.div_ceil(rps);
    let cfg = LaunchConfig {
        grid_dim: (blocks_x as u32, splits as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, rps, splits)
}

/// One warp per row, 8 warps a block, at most 8 blocks per SM (grid-stride over rows).
pub fn cfg_warp_rows(dev: &CudaDevice, rows: usize) -> LaunchConfig {
    let blocks = rows.div_ceil(8).clamp(1, dev.sm_count() * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// Elements of its row a thread keeps in registers in the row-in-registers kernels, with a float
/// accumulator (f32, f16, bf16) and with a double one (f64): `FG_ROW_CAP_FLOAT` /
/// `FG_ROW_CAP_DOUBLE` of `row_reduce.cuh`, passed as defines. 32 floats fill 8 16-byte vectors of
/// f32 within the 64 registers a 1024-thread block allows; doubles need more registers each.
pub const ROW_CAP_FLOAT: usize = 32;
/// The row-in-registers cap with a double accumulator (see [`ROW_CAP_FLOAT`]).
pub const ROW_CAP_DOUBLE: usize = 8;

/// Launch shape for the row-in-registers kernels (`kernels/include/row_reduce.cuh`:
/// `softmax_rows_*`, `layer_norm_fwd_rows_*`), or `None` where they do not apply and the caller
/// launches its general kernel with `cfg_rows`. `aligned`: every pointer the kernel reads or writes
/// row-wise is 16-byte aligned. They apply when `cols` is a multiple of 16 / `elem_bytes` and at
/// most 1024 * E (E = `fg_row_cap`: [`ROW_CAP_FLOAT`] elements a thread with a float accumulator,
/// [`ROW_CAP_DOUBLE`] with a double): rows of up to 32 * E elements go to a power-of-two group of lanes within a warp
/// (several rows a warp when short), 4 warps a block; longer rows to a block of one thread per
/// 32 elements (at least cols / E, a power of two, 64..=1024). One block per row (per 4 warps' rows),
/// no cap: measured on an H200 (f32, % of copy), capping the grid at one resident wave cost 10
/// points at 8192 x 8192 (softmax 87 against 97) and 2..7 at 65536 x 1024.
pub fn cfg_row_regs(
    rows: usize,
    cols: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    aligned: bool,
) -> Option<LaunchConfig> {
    let e = if acc_bytes == 8 { ROW_CAP_DOUBLE } else { ROW_CAP_FLOAT };
    let v = 16 / elem_bytes.max(1); // elements per 16-byte access
    if !aligned || cols == 0 || !cols.is_multiple_of(v) || cols > 1024 * e {
        return None;
    }
    let (threads, blocks) = if cols <= 32 * e {
        let lanes = (cols / v).div_ceil(e / v).next_power_of_two(); // lanes a row takes: 1..=32
        (128, rows.div_ceil(32 / lanes * 4))
    } else {
        let threads = cols.div_ceil(32).next_power_of_two().clamp(64, 1024);
        (threads.max(cols.div_ceil(e).next_power_of_two()), rows)
    };
    Some(LaunchConfig {
        grid_dim: (blocks.clamp(1, i32::MAX as usize) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The kernel-name suffix of width-only kernels (copies, gathers, fills): `b8 b16 b32 b64`.
pub(crate) fn width_suffix(dtype: DType) -> &'static str {
    match dtype.size_in_bytes() {
        1 => "b8",
        2 => "b16",
        4 => "b32",
        _ => "b64",
    }
}

/// Launch `$name` from `$module` on this thread's current stream (`CudaDevice::stream`) with the
/// given arguments, through `CudaDevice::launch_args`: the arguments' pointers on the stack and one
/// `cuLaunchKernel` (cudarc's launch builder would collect them in a `Vec` per launch). Each
/// argument is bound to a local first, so it outlives the launch call.
macro_rules! launch {
    ($dev:expr, $module:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let name: &str = &$name;
        let f = $dev.func(&$module, name)?;
        let mut args = $crate::cuda::device::KernelArgs::new();
        $crate::cuda::launch::launch!(@push args; $($arg),*);
        // SAFETY: argument types and counts follow docs/kernel-abi.md for this kernel; every
        // pointer refers to a live buffer of the right length.
        unsafe { $dev.launch_args(&f, name, $cfg, &mut args) }?;
    }};
    (@push $b:ident; ) => {};
    (@push $b:ident; $head:expr $(, $tail:expr)*) => {
        let h = $head;
        $b.push(&h);
        $crate::cuda::launch::launch!(@push $b; $($tail),*);
    };
}
pub(crate) use launch;

// ---- the function cache -------------------------------------------------------------------------

/// One loaded module: which [`Module`] it was loaded from, and its functions by name.
struct Loaded<M, F> {
    module: Module,
    /// Source addresses already known to hold `module`'s text (a `const` may live at several).
    seen: Vec<usize>,
    handle: M,
    funcs: HashMap<String, F>,
}

/// Kernels by (module name, kernel name), so that a model's kernel named like a core kernel is
/// its own. Two different modules under one name are an error, not a silent substitution. Generic
/// over the driver's module and function handles so that the bookkeeping is tested without a GPU.
pub(crate) struct FuncCache<M, F> {
    modules: Mutex<HashMap<&'static str, Loaded<M, F>>>,
}

impl<M, F> Default for FuncCache<M, F> {
    fn default() -> Self {
        FuncCache { modules: Mutex::new(HashMap::new()) }
    }
}

impl<M: Clone, F: Clone> FuncCache<M, F> {
    /// `name` from `module`, loading the module (`load_module`) and the function (`load_func`)
    /// on first use.
    pub(crate) fn get(
        &self,
        module: &Module,
        name: &str,
        load_module: impl FnOnce(&Module) -> Result<M>,
        load_func: impl FnOnce(&M, &str) -> Result<F>,
    ) -> Result<F> {
        let mut map = self.modules.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = match map.get_mut(module.name) {
            Some(e) => {
                check_same(e, module)?;
                e
            }
            None => {
                // Loaded under the lock: a second thread wanting the same module waits for this
                // one instead of loading it again (modules load once, at start-up).
                let handle = load_module(module)?;
                let loaded =
                    Loaded { module: *module, seen: vec![module.src.as_ptr() as usize], handle, funcs: HashMap::new() };
                map.entry(module.name).or_insert(loaded)
            }
        };
        if let Some(f) = entry.funcs.get(name) {
            return Ok(f.clone());
        }
        let f = load_func(&entry.handle, name)?;
        entry.funcs.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// The names of the modules loaded so far, sorted.
    pub(crate) fn names(&self) -> Vec<&'static str> {
        let mut v: Vec<&'static str> =
            self.modules.lock().unwrap_or_else(PoisonError::into_inner).keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The loaded handle of `module`, loading it on first use.
    pub(crate) fn module(&self, module: &Module, load_module: impl FnOnce(&Module) -> Result<M>) -> Result<M> {
        let mut map = self.modules.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = map.get_mut(module.name) {
            check_same(e, module)?;
            return Ok(e.handle.clone());
        }
        let handle = load_module(module)?;
        let seen = vec![module.src.as_ptr() as usize];
        map.insert(module.name, Loaded { module: *module, seen, handle: handle.clone(), funcs: HashMap::new() });
        Ok(handle)
    }
}

/// Whether `module` is the module loaded under its name: a pointer comparison on the hot path,
/// the full text once per new address.
fn check_same<M, F>(e: &mut Loaded<M, F>, module: &Module) -> Result<()> {
    let addr = module.src.as_ptr() as usize;
    if e.seen.contains(&addr) {
        return Ok(());
    }
    if e.module != *module {
        return Err(Error::Kernel {
            name: module.name.to_string(),
            msg: format!(
                "two different kernel modules are named `{}`; rename one (module names are the cache's keys)",
                module.name
            ),
        });
    }
    e.seen.push(addr);
    Ok(())
}

/// The loaded functions of a device, shared by its launches.
pub(crate) type DeviceFuncs = FuncCache<Arc<cudarc::driver::CudaModule>, cudarc::driver::CudaFunction>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const CORE: Module = Module::new("core", "extern \"C\" __global__ void fill_b32() {}");
    const MODEL: Module = Module::new("model", "extern \"C\" __global__ void fill_b32() { /* mine */ }");
    const IMPOSTOR: Module = Module::new("core", "extern \"C\" __global__ void other() {}");

    /// A kernel named like a core kernel, in another module, is its own function.
    #[test]
    fn functions_are_keyed_by_module_and_name() {
        let cache: FuncCache<&'static str, String> = FuncCache::default();
        let loads = Cell::new(0);
        let get = |m: &Module, n: &str| {
            cache.get(
                m,
                n,
                |m| {
                    loads.set(loads.get() + 1);
                    Ok(m.name)
                },
                |h, n| Ok(format!("{h}::{n}")),
            )
        };
        assert_eq!(get(&CORE, "fill_b32").unwrap(), "core::fill_b32");
        assert_eq!(get(&MODEL, "fill_b32").unwrap(), "model::fill_b32");
        assert_eq!(get(&CORE, "fill_b32").unwrap(), "core::fill_b32");
        assert_eq!(get(&CORE, "copy_b8").unwrap(), "core::copy_b8");
        assert_eq!(loads.get(), 2, "each module loads once");
    }

    #[test]
    fn two_modules_under_one_name_are_an_error() {
        let cache: FuncCache<&'static str, String> = FuncCache::default();
        let load = |m: &Module| Ok(m.name);
        cache.get(&CORE, "fill_b32", load, |h, n| Ok(format!("{h}::{n}"))).unwrap();
        let e = cache.get(&IMPOSTOR, "fill_b32", load, |h, n| Ok(format!("{h}::{n}"))).unwrap_err();
        assert!(e.to_string().contains("two different kernel modules are named `core`"), "{e}");
        assert!(cache.module(&IMPOSTOR, load).is_err());
        // The same text at another address is the same module.
        let copy = Module::new("core", String::leak(CORE.src.to_string()));
        assert_eq!(cache.get(&copy, "fill_b32", load, |_, _| Ok("reloaded".into())).unwrap(), "core::fill_b32");
    }

    #[test]
    fn a_failed_load_is_retried() {
        let cache: FuncCache<&'static str, String> = FuncCache::default();
        let e = cache.get(&CORE, "k", |_| Err(Error::Cuda("no".into())), |_, _| Ok(String::new()));
        assert!(e.is_err());
        assert_eq!(cache.get(&CORE, "k", |m| Ok(m.name), |h, n| Ok(format!("{h}::{n}"))).unwrap(), "core::k");
    }
}
