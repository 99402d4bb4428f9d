//! `Tensor`: a cheap-to-clone handle (an `Arc`) to storage, a layout over it, and the op that made
//! it. Views share storage; every other op returns a new contiguous tensor. Ops on tensors that
//! track gradients record an `Op` so that `backward()` can walk the graph.

use crate::backend::BackendStorage;
use crate::cpu::CpuStorage;
use crate::op::Op;
use crate::rng::{self, Rng};
use crate::shape::MAX_ELEMS;
use crate::storage::Storage;
use crate::{backprop, shape_err, DType, Device, Dim, Error, Layout, Result, Shape, WithDType};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A process-unique identity of a tensor handle: the key of a [`GradStore`](crate::GradStore).
/// Views and `requires_grad()` get new ids; clones of a handle share one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(usize);

impl TensorId {
    pub(crate) fn new() -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(1);
        TensorId(COUNTER.fetch_add(1, Ordering::Relaxed))
    }
}

pub(crate) struct Inner {
    pub(crate) id: TensorId,
    /// Page-lock registration of a pinned CPU tensor's buffer; declared before `storage` so that
    /// it is dropped (unregistered) before the memory it covers is freed.
    pub(crate) pinned: Option<Arc<crate::cuda::pinned::HostPin>>,
    pub(crate) storage: Arc<RwLock<Storage>>,
    pub(crate) layout: Layout,
    pub(crate) op: Option<Op>,
    pub(crate) is_variable: bool,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
}

/// An n-dimensional array on a device, with reverse-mode autograd: PyTorch's `torch.Tensor`.
/// Cloning is cheap (an `Arc`); views (`narrow`, `transpose`, `broadcast_as`, ...) share storage.
/// Every op checks shapes, dtypes and devices and returns a typed [`Error`] instead of panicking;
/// operands must have the same dtype and device (nothing is promoted or moved implicitly).
/// ```
/// use ferrograd_core::{DType, Device, Tensor};
/// let a = Tensor::from_vec(vec![1f32, 2., 3., 4.], (2, 2), Device::Cpu)?;
/// let b = Tensor::ones((2,), DType::F32, Device::Cpu)?; // broadcasts over rows
/// assert_eq!(a.add(&b)?.to_vec2::<f32>()?, [[2., 3.], [4., 5.]]);
/// # Ok::<(), ferrograd_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<Inner>);

impl Drop for Inner {
    /// Each `Op` owns its inputs, so dropping the output of a long chain (an unrolled loop, tens of
    /// thousands of ops deep) would recurse once per op and overflow the stack. Unlink the graph
    /// iteratively instead: take the inputs this node was the last owner of and strip their ops.
    fn drop(&mut self) {
        let Some(op) = self.op.take() else { return };
        let mut pending: Vec<Tensor> = backprop::op_inputs(&op).into_iter().cloned().collect();
        drop(op);
        while let Some(t) = pending.pop() {
            if let Ok(mut inner) = Arc::try_unwrap(t.0) {
                if let Some(op) = inner.op.take() {
                    pending.extend(backprop::op_inputs(&op).into_iter().cloned());
                }
                // `inner` drops here with no op left, so this does not recurse.
            }
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor[{:?}, {}, {}]", self.dims(), self.dtype(), self.device())
    }
}

impl Tensor {
    // ---- construction -------------------------------------------------------------------------

    /// Wrap a new storage as a contiguous tensor of `shape`. Callers computed the storage from a
    /// checked shape; the storage must cover it.
    pub(crate) fn from_storage<S: Into<Shape>>(storage: Storage, shape: S, op: Option<Op>) -> Tensor {
        let dtype = storage.dtype();
        let device = storage.device();
        let shape = shape.into();
        debug_assert!(
            shape.elem_count() <= MAX_ELEMS && shape.elem_count() <= storage.len(),
            "storage of {} elements does not cover shape {shape:?}",
            storage.len()
        );
        Tensor(Arc::new(Inner {
            id: TensorId::new(),
            pinned: None,
            storage: Arc::new(RwLock::new(storage)),
            layout: Layout::contiguous(shape),
            op,
            is_variable: false,
            dtype,
            device,
        }))
    }

    /// A new view over the same storage, which must cover `layout` (views only ever narrow,
    /// reorder or broadcast a covered layout; the assertion guards that claim in debug builds and
    /// `tests/core_suite/sizes.rs` checks it for every view).
    pub(crate) fn view(&self, layout: Layout, op: Option<Op>) -> Tensor {
        debug_assert!(
            layout.elem_count() <= MAX_ELEMS && layout.required_len().is_some_and(|n| n <= self.storage_len()),
            "view {layout:?} reaches past its storage of {} elements",
            self.storage_len()
        );
        Tensor(Arc::new(Inner {
            id: TensorId::new(),
            pinned: self.0.pinned.clone(),
            storage: self.0.storage.clone(),
            layout,
            op,
            is_variable: false,
            dtype: self.0.dtype,
            device: self.0.device,
        }))
    }

    pub(crate) fn cpu_to_device(s: CpuStorage, device: Device) -> Result<Storage> {
        Storage::from_cpu(s, device)
    }

    /// Philox numbers for `n` elements: drawn on the device itself for CUDA tensors.
    fn random_storage(
        rng: &mut Rng,
        normal: bool,
        n: usize,
        a: f64,
        b: f64,
        dtype: DType,
        device: Device,
    ) -> Result<Storage> {
        let (seed, off) = rng.advance(n);
        match device {
            Device::Cpu => {
                let it = (0..n).map(|i| {
                    if normal {
                        a + b * rng::normal_at(seed, off, i as u64)
                    } else {
                        a + (b - a) * rng::uniform_at(seed, off, i as u64)
                    }
                });
                Ok(Storage::Cpu(CpuStorage::from_f64_iter(it, dtype)?))
            }
            Device::Cuda(o) => {
                let dev = crate::cuda::CudaDevice::get(o)?;
                Ok(Storage::Cuda(crate::cuda::CudaStorage::random(&dev, normal, n, dtype, seed, off, a, b)?))
            }
        }
    }

    /// A tensor of `shape` holding `data` (row-major), on `device` (`torch.tensor(data).reshape(shape)`).
    /// The dtype is `T`'s. Errors with [`Error::ElementCount`] when `data.len()` is not the shape's
    /// element count, and with a CUDA error when `device` is not usable.
    pub fn from_vec<T: WithDType, S: Into<Shape>>(data: Vec<T>, shape: S, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.checked_elem_count("from_vec")?;
        if n != data.len() {
            return Err(Error::ElementCount { op: "from_vec", expected: n, got: data.len() });
        }
        Ok(Self::from_storage(Self::cpu_to_device(T::to_cpu_storage(data), device)?, shape, None))
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    pub fn from_slice<T: WithDType, S: Into<Shape>>(data: &[T], shape: S, device: Device) -> Result<Tensor> {
        Self::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-d tensor holding `v`.
    pub fn scalar<T: WithDType>(v: T, device: Device) -> Result<Tensor> {
        Self::from_vec(vec![v], (), device)
    }

    /// A tensor of `shape` with every element `value` converted to `dtype` (`torch.full`).
    pub fn full<S: Into<Shape>>(value: f64, shape: S, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.checked_elem_count("full")?;
        Ok(Self::from_storage(Storage::full(value, n, dtype, device)?, shape, None))
    }

    /// Zeros of `shape`, `dtype`, on `device` (`torch.zeros`).
    pub fn zeros<S: Into<Shape>>(shape: S, dtype: DType, device: Device) -> Result<Tensor> {
        Self::full(0.0, shape, dtype, device)
    }

    /// Ones of `shape`, `dtype`, on `device` (`torch.ones`).
    pub fn ones<S: Into<Shape>>(shape: S, dtype: DType, device: Device) -> Result<Tensor> {
        Self::full(1.0, shape, dtype, device)
    }

    /// Zeros of this tensor's shape, dtype and device (`torch.zeros_like`).
    pub fn zeros_like(&self) -> Result<Tensor> {
        Self::zeros(self.shape().clone(), self.dtype(), self.device())
    }

    /// Ones of this tensor's shape, dtype and device (`torch.ones_like`).
    pub fn ones_like(&self) -> Result<Tensor> {
        Self::ones(self.shape().clone(), self.dtype(), self.device())
    }

    /// `v` in this tensor's shape, dtype and device (`torch.full_like`).
    pub fn full_like(&self, v: f64) -> Result<Tensor> {
        Self::full(v, self.shape().clone(), self.dtype(), self.device())
    }

    /// `start, start + step, ...` below `end` (above it for a negative step).
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::InvalidArgument(format!("arange({start}, {end}, {step}): bad range")));
        }
        let count = ((end - start) / step).ceil().max(0.0);
        if count > MAX_ELEMS as f64 {
            return Err(Error::SizeOverflow {
                op: "arange",
                shape: vec![count.min(usize::MAX as f64) as usize],
                why: format!("arange({start}, {end}, {step}) has {count:e} elements"),
            });
        }
        let n = count as usize;
        let s = CpuStorage::from_f64_iter((0..n).map(|i| start + i as f64 * step), dtype)?;
        Ok(Self::from_storage(Self::cpu_to_device(s, device)?, n, None))
    }

    /// Uniform in `[lo, hi)` from `rng` (Philox; the same numbers on every backend).
    pub fn rand_with<S: Into<Shape>>(
        rng: &mut Rng,
        lo: f64,
        hi: f64,
        shape: S,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let s = Self::random_storage(rng, false, shape.checked_elem_count("rand")?, lo, hi, dtype, device)?;
        Ok(Self::from_storage(s, shape, None))
    }

    /// Normal with `mean` and `std` from `rng`.
    pub fn randn_with<S: Into<Shape>>(
        rng: &mut Rng,
        mean: f64,
        std: f64,
        shape: S,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let s = Self::random_storage(rng, true, shape.checked_elem_count("randn")?, mean, std, dtype, device)?;
        Ok(Self::from_storage(s, shape, None))
    }

    /// Uniform from the default generator (`manual_seed`).
    pub fn rand<S: Into<Shape>>(lo: f64, hi: f64, shape: S, dtype: DType, device: Device) -> Result<Tensor> {
        rng::with_global_rng(|r| Self::rand_with(r, lo, hi, shape, dtype, device))
    }

    /// Normal from the default generator (`manual_seed`).
    pub fn randn<S: Into<Shape>>(mean: f64, std: f64, shape: S, dtype: DType, device: Device) -> Result<Tensor> {
        rng::with_global_rng(|r| Self::randn_with(r, mean, std, shape, dtype, device))
    }

    // ---- accessors ----------------------------------------------------------------------------

    /// This handle's identity (the key of its gradient in a [`GradStore`](crate::GradStore)).
    pub fn id(&self) -> TensorId {
        self.0.id
    }
    /// The shape, strides and offset this tensor views its storage with.
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    /// The shape (`t.shape`).
    pub fn shape(&self) -> &Shape {
        self.0.layout.shape()
    }
    /// The sizes of the dimensions, outermost first (`t.shape` as a slice).
    pub fn dims(&self) -> &[usize] {
        self.0.layout.dims()
    }
    /// The number of dimensions (`t.dim()`).
    pub fn rank(&self) -> usize {
        self.dims().len()
    }
    /// The number of elements (`t.numel()`).
    pub fn elem_count(&self) -> usize {
        self.0.layout.elem_count()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// The device the storage lives on.
    pub fn device(&self) -> Device {
        self.0.device
    }
    /// The op that produced this tensor, when it was recorded for autograd.
    pub fn op(&self) -> Option<&Op> {
        self.0.op.as_ref()
    }
    /// Whether this is a leaf that collects a gradient (made by [`Tensor::requires_grad`]).
    pub fn is_variable(&self) -> bool {
        self.0.is_variable
    }
    /// Whether the elements are laid out row-major without gaps (`t.is_contiguous()`).
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// Whether gradients flow through this tensor.
    pub fn tracks_grad(&self) -> bool {
        self.0.is_variable || self.0.op.is_some()
    }
    /// The size of dimension `d` (negative counts from the end, like `t.size(d)`); errors with
    /// [`Error::DimOutOfRange`].
    pub fn dim<D: Dim>(&self, d: D) -> Result<usize> {
        Ok(self.dims()[d.to_index(self.rank(), "dim")?])
    }
    /// Elements the underlying storage holds (at least what the layout reaches).
    #[doc(hidden)]
    pub fn storage_len(&self) -> usize {
        self.storage().len()
    }
    /// Whether two tensors share storage.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    pub(crate) fn storage(&self) -> RwLockReadGuard<'_, Storage> {
        self.0.storage.read().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn storage_mut(&self) -> RwLockWriteGuard<'_, Storage> {
        self.0.storage.write().unwrap_or_else(|e| e.into_inner())
    }

    // ---- autograd bookkeeping -----------------------------------------------------------------

    /// A leaf variable sharing this tensor's storage: gradients are collected for it.
    pub fn requires_grad(&self) -> Tensor {
        Tensor(Arc::new(Inner {
            id: TensorId::new(),
            pinned: self.0.pinned.clone(),
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            op: None,
            is_variable: true,
            dtype: self.0.dtype,
            device: self.0.device,
        }))
    }

    /// The same values, cut from the graph.
    pub fn detach(&self) -> Tensor {
        if !self.tracks_grad() {
            return self.clone();
        }
        self.view(self.layout().clone(), None)
    }

    /// Reverse-mode gradients of this scalar with respect to every tensor it depends on.
    pub fn backward(&self) -> Result<backprop::GradStore> {
        let mut store = backprop::GradStore::default();
        backprop::backward(self, &mut store)?;
        Ok(store)
    }

    /// Gradients with respect to every tensor this one depends on, given `grad`, the gradient of
    /// some loss with respect to this tensor (same shape, dtype and device): PyTorch's
    /// `t.backward(grad)`.
    pub fn backward_with(&self, grad: &Tensor) -> Result<backprop::GradStore> {
        let mut store = backprop::GradStore::default();
        backprop::backward_from(self.clone(), grad.clone(), &mut store, None)?;
        Ok(store)
    }

    /// Like `backward`, adding into an existing store (gradient accumulation over several losses).
    pub fn backward_into(&self, store: &mut backprop::GradStore) -> Result<()> {
        backprop::backward(self, store)
    }

    /// Like `backward_with` (this tensor's gradient given), adding into an existing store: how a
    /// training step backpropagates the logits' gradient that the fused classifier formed.
    pub fn backward_into_with(&self, grad: &Tensor, store: &mut backprop::GradStore) -> Result<()> {
        backprop::backward_from(self.clone(), grad.clone(), store, None)
    }

    /// `backward_into_with` (with `on_leaf` as `backward_into_with_seed_hook` takes it) that takes
    /// this tensor: when it was the caller's last handle on the graph, every op's saved tensors
    /// are freed as the walk differentiates it (PyTorch's default, no `retain_graph`), so the
    /// activations do not all outlive the backward. A training step's way to backpropagate.
    pub fn backward_consume(
        self,
        grad: &Tensor,
        store: &mut backprop::GradStore,
        on_leaf: Option<backprop::LeafHook<'_>>,
    ) -> Result<()> {
        backprop::backward_from(self, grad.clone(), store, on_leaf)
    }

    /// Like `backward_into`, calling `on_leaf(leaf, grad)` as soon as each leaf variable's
    /// gradient is final, in the order the walk finishes them (reverse topological order). An
    /// error from the hook stops the walk and is returned.
    pub fn backward_into_with_hook(
        &self,
        store: &mut backprop::GradStore,
        on_leaf: &mut dyn FnMut(&Tensor, &Tensor) -> Result<()>,
    ) -> Result<()> {
        backprop::backward_with_hook(self, store, Some(on_leaf))
    }

    /// `backward_into_with` (this tensor's gradient `grad` given) calling `on_leaf` as each leaf's
    /// gradient becomes final, as `backward_into_with_hook` does: how a data-parallel training step
    /// starts averaging gradients while it backpropagates the fused classifier's logits gradient.
    pub fn backward_into_with_seed_hook(
        &self,
        grad: &Tensor,
        store: &mut backprop::GradStore,
        on_leaf: &mut dyn FnMut(&Tensor, &Tensor) -> Result<()>,
    ) -> Result<()> {
        backprop::backward_from(self.clone(), grad.clone(), store, Some(on_leaf))
    }

    /// Overwrite this tensor's elements with `src`'s (same shape and dtype), keeping identity and
    /// storage: how optimizers update parameters in place.
    pub fn set(&self, src: &Tensor) -> Result<()> {
        if src.dims() != self.dims() {
            return Err(Error::ShapeMismatch { op: "set", lhs: self.dims().to_vec(), rhs: src.dims().to_vec() });
        }
        if src.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "set", lhs: self.dtype(), rhs: src.dtype() });
        }
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch { op: "set", lhs: self.device(), rhs: src.device() });
        }
        if !self.is_contiguous() {
            return Err(shape_err!("set", "destination must be contiguous"));
        }
        if self.same_storage(src) {
            let copy = src.storage().copy_strided(src.layout())?;
            return copy.copy_strided_into(
                &Layout::contiguous(self.shape().clone()),
                &mut self.storage_mut(),
                self.layout().offset(),
            );
        }
        let s = src.storage();
        s.copy_strided_into(src.layout(), &mut self.storage_mut(), self.layout().offset())
    }

    /// The device address of the first element of a contiguous CUDA tensor, for a model's own
    /// kernels (`CudaDevice::launch_raw`). The address is valid while this tensor lives.
    pub fn cuda_ptr(&self) -> Result<u64> {
        if !self.is_contiguous() {
            return Err(shape_err!("cuda_ptr", "tensor of shape {:?} is not contiguous", self.dims()));
        }
        match &*self.storage() {
            Storage::Cuda(c) => Ok(c.buf.ptr_at(self.layout().offset())),
            Storage::Cpu(_) => Err(Error::DeviceMismatch { op: "cuda_ptr", lhs: Device::Cuda(0), rhs: Device::Cpu }),
        }
    }

    // ---- reading values -----------------------------------------------------------------------

    /// The viewed elements on the host (the one place a CUDA tensor synchronises).
    pub(crate) fn cpu_storage(&self) -> Result<CpuStorage> {
        self.storage().to_cpu(self.layout())
    }

    /// All elements in row-major order; `T` must match the dtype.
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch { op: "to_vec", lhs: self.dtype(), rhs: T::DTYPE });
        }
        let c = self.cpu_storage()?;
        Ok(c.as_slice::<T>()?.to_vec())
    }

    /// Rows of a 2-d tensor.
    pub fn to_vec2<T: WithDType>(&self) -> Result<Vec<Vec<T>>> {
        if self.rank() != 2 {
            return Err(shape_err!("to_vec2", "expected rank 2, got shape {:?}", self.dims()));
        }
        let cols = self.dims()[1];
        let v = self.to_vec::<T>()?;
        Ok(if cols == 0 { vec![vec![]; self.dims()[0]] } else { v.chunks(cols).map(|c| c.to_vec()).collect() })
    }

    /// All elements as f64 (exact for every dtype).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let c = self.cpu_storage()?;
        c.to_f64_vec(&Layout::contiguous(self.shape().clone()))
    }

    /// The single element of a one-element tensor.
    pub fn item<T: WithDType>(&self) -> Result<T> {
        if self.elem_count() != 1 {
            return Err(Error::NotAScalar { op: "item", shape: self.dims().to_vec() });
        }
        self.to_vec::<T>()?.pop().ok_or(Error::NotAScalar { op: "item", shape: self.dims().to_vec() })
    }

    /// The single element as f64, whatever the dtype.
    pub fn item_f64(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            return Err(Error::NotAScalar { op: "item", shape: self.dims().to_vec() });
        }
        Ok(self.to_f64_vec()?[0])
    }
}
