//! Reverse-mode autodiff. `backward()` sorts the graph below a scalar once, then walks it from the
//! output to the leaves, applying one rule per `Op`. A node's gradient is removed from the working
//! map as soon as it has been pushed to its inputs, so intermediate buffers die during the walk;
//! only leaf variables' gradients reach the returned `GradStore`, each stored as soon as its last
//! user has been differentiated (`backward_into_with_hook` reports it then).

use crate::narrow_grads::NarrowGrads;
use crate::op::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::{DType, Error, Result, Tensor, TensorId};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread are recorded for autograd (`torch.is_grad_enabled()`); false inside
/// [`no_grad`] / [`with_no_grad`].
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode on drop.
pub struct NoGradGuard(bool);

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.0));
    }
}

/// Stop recording ops on this thread until the guard drops.
pub fn no_grad() -> NoGradGuard {
    NoGradGuard(GRAD_ENABLED.with(|g| g.replace(false)))
}

/// Run `f` without recording ops.
pub fn with_no_grad<T>(f: impl FnOnce() -> T) -> T {
    let _g = no_grad();
    f()
}

/// Whether an op on these inputs must be recorded.
pub(crate) fn track(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.tracks_grad())
}

/// Gradients of leaf variables, by tensor id. `Debug` so that `Result<GradStore>` can be unwrapped.
#[derive(Default, Clone, Debug)]
pub struct GradStore(HashMap<TensorId, Tensor>);

impl GradStore {
    /// The gradient of `t` (same shape, dtype and device), if `t` is a leaf the loss depends on.
    pub fn get(&self, t: &Tensor) -> Option<&Tensor> {
        self.0.get(&t.id())
    }
    /// The gradient stored under a tensor id.
    pub fn get_id(&self, id: TensorId) -> Option<&Tensor> {
        self.0.get(&id)
    }
    /// Take `t`'s gradient out of the store.
    pub fn remove(&mut self, t: &Tensor) -> Option<Tensor> {
        self.0.remove(&t.id())
    }
    /// Set `t`'s gradient (returns the one it replaces); how gradients from elsewhere (an all-reduce,
    /// a hand-written backward) are put back for an optimizer.
    pub fn insert(&mut self, t: &Tensor, g: Tensor) -> Option<Tensor> {
        self.0.insert(t.id(), g)
    }
    /// The number of gradients held.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Whether no gradient is held.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Drop every gradient (PyTorch's `zero_grad(set_to_none=True)`).
    pub fn clear(&mut self) {
        self.0.clear()
    }
    /// The ids of the tensors that have a gradient.
    pub fn ids(&self) -> impl Iterator<Item = &TensorId> {
        self.0.keys()
    }
    /// Add `g` to the gradient stored for `id`.
    fn accumulate(map: &mut HashMap<TensorId, Tensor>, id: TensorId, g: Tensor) -> Result<()> {
        match map.remove(&id) {
            Some(prev) => {
                map.insert(id, prev.add(&g)?);
            }
            None => {
                map.insert(id, g);
            }
        }
        Ok(())
    }
}

/// The differentiable inputs of `op` (also used to unlink deep graphs on drop).
pub(crate) fn op_inputs(op: &Op) -> Vec<&Tensor> {
    match op {
        Op::Unary(x, _)
        | Op::Reduce(x, _, _)
        | Op::Reshape(x)
        | Op::Permute(x, _)
        | Op::Narrow(x, _, _)
        | Op::Broadcast(x)
        | Op::Copy(x)
        | Op::ToDType(x)
        | Op::IndexSelect(x, _, _)
        | Op::Gather(x, _, _) => vec![x],
        Op::Binary(a, b, _) | Op::Matmul(a, b) => vec![a, b],
        Op::WhereCond(_, t, f) => vec![t, f],
        Op::Cat(xs, _) => xs.iter().collect(),
        Op::Fused(rec) => rec.inputs.iter().collect(),
    }
}

/// Nodes that lead to a tracked leaf, in topological order (inputs before outputs).
fn topo_order(root: &Tensor) -> Vec<Tensor> {
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    // Iterative post-order DFS: deep graphs (long training unrolls) must not overflow the stack.
    let mut stack: Vec<(Tensor, bool)> = vec![(root.clone(), false)];
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        stack.push((t.clone(), true));
        if let Some(op) = t.op() {
            for i in op_inputs(op) {
                if i.tracks_grad() && !seen.contains(&i.id()) {
                    stack.push((i.clone(), false));
                }
            }
        }
    }
    order
}

/// Called once per leaf variable during a backward walk, when that leaf's gradient is final (every
/// op that uses the leaf has been differentiated), with the leaf and its gradient as stored (summed
/// with what the store held before). Leaves become final in reverse topological order, so a
/// data-parallel wrapper can start communicating gradients while the rest of the walk runs.
pub type LeafHook<'a> = &'a mut dyn FnMut(&Tensor, &Tensor) -> Result<()>;

pub(crate) fn backward(root: &Tensor, store: &mut GradStore) -> Result<()> {
    backward_with_hook(root, store, None)
}

pub(crate) fn backward_with_hook(root: &Tensor, store: &mut GradStore, on_leaf: Option<LeafHook>) -> Result<()> {
    if root.elem_count() != 1 {
        return Err(Error::Backward(format!("needs a scalar loss, got shape {:?}", root.dims())));
    }
    backward_from(root.clone(), root.ones_like()?, store, on_leaf)
}

/// Backpropagate `seed` (the gradient of some loss with respect to `root`, root's shape) into
/// `store`: PyTorch's `root.backward(seed)`. `on_leaf` sees each leaf's gradient once it is final.
///
/// The walk owns `root` and lets go of each node once it is differentiated, so where nothing else
/// holds the graph (the caller handed over its last handle on `root`, and kept no other tensor
/// of the graph) each op's saved tensors are freed as the walk passes it, as PyTorch frees them
/// without `retain_graph`: a training step's activations go while its gradients arrive, instead
/// of all of them living until the backward ends (GPT-2 124M at 16 x 1024: 7.5 GB).
pub(crate) fn backward_from(
    root: Tensor,
    seed: Tensor,
    store: &mut GradStore,
    mut on_leaf: Option<LeafHook>,
) -> Result<()> {
    let _nvtx = crate::cuda::nvtx::range("backward");
    if seed.dims() != root.dims() || seed.dtype() != root.dtype() || seed.device() != root.device() {
        return Err(Error::Backward(format!(
            "the seed gradient ({:?} {} on {}) must match the tensor ({:?} {} on {})",
            seed.dims(),
            seed.dtype(),
            seed.device(),
            root.dims(),
            root.dtype(),
            root.device()
        )));
    }
    if !root.tracks_grad() {
        return Err(Error::Backward("the loss does not depend on any variable that requires grad".into()));
    }
    let _guard = crate::backprop::no_grad();
    let mut order = topo_order(&root);
    let root_id = root.id();
    drop(root);
    // Creation order is a topological order too (an op's output is made after its inputs), and
    // walking it backwards differentiates each node as soon as the ops created after it are done:
    // a weight's transpose right after the matmul that used it, not after every earlier layer as
    // the depth-first order would (PyTorch's engine orders by creation sequence the same way).
    order.sort_unstable_by_key(|t| t.id());
    // Uses of each node by other nodes of the walk. The depth-first order puts a leaf as early as
    // it was first seen, so in reverse it would come last; counting uses lets a leaf's gradient
    // be stored (and reported) as soon as its last user has been differentiated instead.
    let mut uses: HashMap<TensorId, usize> = HashMap::new();
    for node in &order {
        if let Some(op) = node.op() {
            for i in op_inputs(op).into_iter().filter(|i| i.tracks_grad()) {
                *uses.entry(i.id()).or_default() += 1;
            }
        }
    }
    let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
    grads.insert(root_id, seed.detach());
    let mut slices = NarrowGrads::default();
    let mut finish_leaf = |leaf: &Tensor, g: Tensor, store: &mut GradStore| -> Result<()> {
        // A gradient takes its leaf's layout, as PyTorch's AccumulateGrad keeps a gradient in its
        // parameter's strides: a contiguous leaf handed a view (a transposed or broadcast
        // gradient) stores it contiguous, copied once here rather than by every reader (the
        // optimizers' kernels and clipping need contiguous buffers). Ops that can write a
        // gradient in its leaf's layout do (the fused linear's transposed dW), and pay nothing.
        let g = if leaf.is_contiguous() && !g.is_contiguous() { g.contiguous()? } else { g };
        GradStore::accumulate(&mut store.0, leaf.id(), g)?;
        if let (Some(hook), Some(full)) = (on_leaf.as_mut(), store.0.get(&leaf.id())) {
            hook(leaf, full)?;
        }
        Ok(())
    };
    for node in order.into_iter().rev() {
        let g = slices.take(&mut grads, &node)?;
        let Some(op) = node.op() else {
            // A leaf still here has no users in the walk (the loss itself is a variable).
            if let (true, Some(g)) = (node.is_variable(), g) {
                finish_leaf(&node, g, store)?;
            }
            continue;
        };
        if let (Some(g), Op::Narrow(x, dim, start)) = (&g, op) {
            // Kept as a slice until x's gradient is needed (narrow_grads.rs).
            if x.tracks_grad() {
                slices.push(x, *dim, *start, g.clone());
            }
        } else if let Some(g) = g {
            let pending = take_pending(op, &mut grads);
            for (input, gi) in input_grads(&node, op, &g, &pending)? {
                if input.tracks_grad() {
                    GradStore::accumulate(&mut grads, input.id(), gi)?;
                }
            }
            restore_pending(op, pending, &mut grads);
        }
        for input in op_inputs(op).into_iter().filter(|i| i.tracks_grad()) {
            let left = uses.get_mut(&input.id()).map(|n| {
                *n -= 1;
                *n
            });
            if left == Some(0) && input.is_variable() {
                if let Some(gl) = slices.take(&mut grads, input)? {
                    finish_leaf(input, gl, store)?;
                }
            }
        }
    }
    Ok(())
}

/// The pending gradients a fused op folds into its own (`FusedOp::folds_pending`), one per input,
/// taken out of `grads`: the backward returns them summed with its own, which then go in their
/// place, and an input the walk adds to twice saves that add pass (layer norm's input in a pre-LN
/// transformer: the residual stream, also added to the next block's branch). An input that occurs
/// twice among the op's inputs is not folded (both of its gradients would claim the pending one).
/// Empty for other ops.
fn take_pending(op: &Op, grads: &mut HashMap<TensorId, Tensor>) -> Vec<Option<Tensor>> {
    let Op::Fused(rec) = op else { return vec![] };
    let once = |x: &Tensor| rec.inputs.iter().filter(|y| y.id() == x.id()).count() == 1;
    let folds = |i: usize, x: &Tensor| rec.op.folds_pending(i) && x.tracks_grad() && once(x);
    rec.inputs.iter().enumerate().map(|(i, x)| if folds(i, x) { grads.remove(&x.id()) } else { None }).collect()
}

/// Put back each pending gradient whose input the backward gave no gradient (so none that holds
/// it): a taken gradient is never lost. An input whose gradient was returned has an entry again.
fn restore_pending(op: &Op, pending: Vec<Option<Tensor>>, grads: &mut HashMap<TensorId, Tensor>) {
    let Op::Fused(rec) = op else { return };
    for (x, p) in rec.inputs.iter().zip(pending) {
        if let Some(p) = p {
            grads.entry(x.id()).or_insert(p);
        }
    }
}

/// `g` summed down to `shape` (the adjoint of broadcasting).
pub(crate) fn sum_to(g: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let lead = g.rank() - dims.len();
    let mut red: Vec<usize> = (0..lead).collect();
    for (i, &d) in dims.iter().enumerate() {
        if d == 1 && g.dims()[lead + i] != 1 {
            red.push(lead + i);
        }
    }
    let s = if red.is_empty() { g.clone() } else { g.sum(red, true)? };
    s.reshape(dims.to_vec())
}

fn mask_of(c: Tensor, dtype: DType) -> Result<Tensor> {
    c.to_dtype(dtype)
}

/// The gradient of each input of `node` given the gradient `g` of its output (for a fused op, with
/// the `pending` gradients folded in where it folds them).
fn input_grads(node: &Tensor, op: &Op, g: &Tensor, pending: &[Option<Tensor>]) -> Result<Vec<(Tensor, Tensor)>> {
    Ok(match op {
        Op::Unary(x, u) => {
            let d = match *u {
                UnaryOp::Neg => g.neg()?,
                UnaryOp::Abs => g.mul(&x.sign()?)?,
                UnaryOp::Sqr => g.mul(&x.mul_scalar(2.0)?)?,
                UnaryOp::Sign => return Ok(vec![]),
                UnaryOp::Relu => g.binary_op(x, BinaryOp::MaskPositive)?,
                UnaryOp::Exp => g.mul(node)?,
                UnaryOp::Log => g.div(x)?,
                // d sqrt(x) = 1 / (2 sqrt(x))
                UnaryOp::Sqrt => g.div(&node.mul_scalar(2.0)?)?,
                // d x^-1/2 = -1/2 x^-3/2 = -1/2 rsqrt(x) / x
                UnaryOp::Rsqrt => g.mul(&node.div(x)?.mul_scalar(-0.5)?)?,
                UnaryOp::Recip => g.mul(&node.sqr()?.neg()?)?,
                UnaryOp::Tanh => g.mul(&node.sqr()?.affine(-1.0, 1.0)?)?,
                UnaryOp::Sigmoid => g.mul(&node.mul(&node.affine(-1.0, 1.0)?)?)?,
                UnaryOp::GeluTanh => g.mul(&x.unary_op(UnaryOp::GeluTanhGrad)?)?,
                UnaryOp::GeluErf => g.mul(&x.unary_op(UnaryOp::GeluErfGrad)?)?,
                UnaryOp::Silu => g.mul(&x.unary_op(UnaryOp::SiluGrad)?)?,
                UnaryOp::Sin => g.mul(&x.cos()?)?,
                UnaryOp::Cos => g.mul(&x.sin()?.neg()?)?,
                UnaryOp::Affine { mul, .. } => g.mul_scalar(mul)?,
                UnaryOp::Powf(e) => g.mul(&x.powf(e - 1.0)?.mul_scalar(e)?)?,
                UnaryOp::Clamp { min, max } => {
                    let inside = x.ge(&x.scalar_like(min)?)?.mul(&x.le(&x.scalar_like(max)?)?)?;
                    g.mul(&mask_of(inside, x.dtype())?)?
                }
                UnaryOp::GeluTanhGrad | UnaryOp::GeluErfGrad | UnaryOp::SiluGrad => {
                    return Err(Error::Backward(format!("second derivative through {} is not supported", u.name())))
                }
            };
            vec![(x.clone(), d)]
        }
        Op::Binary(a, b, op) => {
            // Only the operands that track gradients get one: a constant operand (a target, the
            // input batch) costs no kernel.
            let (na, nb) = (a.tracks_grad(), b.tracks_grad());
            let mut out = vec![];
            let pick_a = match op {
                BinaryOp::Maximum => Some(mask_of(a.ge(b)?, g.dtype())?),
                BinaryOp::Minimum => Some(mask_of(a.le(b)?, g.dtype())?),
                _ => None,
            };
            if na {
                let ga = match op {
                    BinaryOp::Add | BinaryOp::Sub | BinaryOp::Rem => g.clone(),
                    BinaryOp::Mul => g.mul(b)?,
                    BinaryOp::Div => g.div(b)?,
                    BinaryOp::Maximum | BinaryOp::Minimum => g.mul(pick_a.as_ref().unwrap_or(g))?,
                    BinaryOp::MaskPositive => {
                        return Err(Error::Backward("mask_positive is not differentiable".into()))
                    }
                };
                out.push((a.clone(), ga));
            }
            if nb {
                let gb = match op {
                    BinaryOp::Add => g.clone(),
                    BinaryOp::Sub => g.neg()?,
                    BinaryOp::Mul => g.mul(a)?,
                    // d(a/b)/db = -a/b^2 = -out/b
                    BinaryOp::Div => g.mul(node)?.div(b)?.neg()?,
                    // a - b * floor(a / b): d/db = -floor(a / b) = (out - a) / b
                    BinaryOp::Rem => g.mul(&node.sub(a)?.div(b)?)?,
                    BinaryOp::Maximum | BinaryOp::Minimum => g.mul(&pick_a.as_ref().unwrap_or(g).affine(-1.0, 1.0)?)?,
                    BinaryOp::MaskPositive => {
                        return Err(Error::Backward("mask_positive is not differentiable".into()))
                    }
                };
                out.push((b.clone(), gb));
            }
            out
        }
        Op::WhereCond(c, t, f) => {
            let z = g.zeros_like()?;
            let mut out = vec![];
            if t.tracks_grad() {
                out.push((t.clone(), c.where_cond(g, &z)?));
            }
            if f.tracks_grad() {
                out.push((f.clone(), c.where_cond(&z, g)?));
            }
            out
        }
        Op::Reduce(x, ReduceOp::Sum, _) => vec![(x.clone(), g.broadcast_as(x.shape().clone())?)],
        Op::Reduce(x, _, dims) => {
            // Ties share the gradient equally (PyTorch's amax/amin rule).
            let hit = mask_of(x.eq(&node.broadcast_as(x.shape().clone())?)?, x.dtype())?;
            let count = hit.sum(dims.clone(), true)?;
            vec![(x.clone(), hit.mul(&g.div(&count)?)?)]
        }
        Op::Matmul(a, b) => {
            let mut out = vec![];
            if a.tracks_grad() {
                out.push((a.clone(), g.matmul(&b.t()?)?));
            }
            if b.tracks_grad() {
                out.push((b.clone(), a.t()?.matmul(g)?));
            }
            out
        }
        Op::Reshape(x) => vec![(x.clone(), g.reshape(x.shape().clone())?)],
        Op::Permute(x, perm) => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![(x.clone(), g.permute(&inv)?)]
        }
        // The rule; the walk itself keeps a narrow's gradient as a slice instead (narrow_grads.rs),
        // which joins slices or falls back to this padding.
        Op::Narrow(x, dim, start) => vec![(x.clone(), crate::narrow_grads::padded(x.dims(), *dim, *start, g)?)],
        Op::Broadcast(x) => vec![(x.clone(), sum_to(g, x.dims())?)],
        Op::Copy(x) => vec![(x.clone(), g.clone())],
        Op::ToDType(x) => vec![(x.clone(), g.to_dtype(x.dtype())?)],
        Op::Cat(xs, dim) => {
            let mut off = 0;
            let mut out = vec![];
            for x in xs {
                let n = x.dims()[*dim];
                out.push((x.clone(), g.narrow(*dim, off, n)?));
                off += n;
            }
            out
        }
        Op::IndexSelect(x, ids, dim) => vec![(x.clone(), x.zeros_like()?.index_add(ids, g, *dim)?)],
        Op::Gather(x, ids, dim) => vec![(x.clone(), x.zeros_like()?.scatter_add(*dim, ids, g)?)],
        Op::Fused(rec) => crate::fused::input_grads(rec, node, g, pending)?,
    })
}
