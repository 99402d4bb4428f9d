//! Which gradients travel together, and when a bucket may go.
//!
//! Parameters are packed into buckets of at most `cap_bytes` (25 MiB by default, PyTorch DDP's
//! figure) in reverse registration order: backward finishes the last layers first, so the first
//! bucket fills first and its all-reduce overlaps the rest of the walk. Each parameter's slot is
//! aligned to `ALIGN` elements; each bucket is padded to a multiple of `world * ALIGN` elements so
//! that it splits into `world` equal, aligned shards (reduce-scatter and ZeRO-1).
//!
//! Buckets are launched strictly in index order, whatever order their gradients finish in: NCCL
//! needs every rank to issue collectives in the same order, and the ranks' walks could differ.

/// Slot alignment in elements (256 bytes of f32).
pub const ALIGN: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub bucket: usize,
    /// Element offset inside the bucket.
    pub offset: usize,
    pub numel: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Indices of the parameters in this bucket, in slot order.
    pub params: Vec<usize>,
    /// Elements including padding; a multiple of `world * ALIGN`.
    pub len: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    pub buckets: Vec<Bucket>,
    /// Per parameter, in registration order.
    pub slots: Vec<Slot>,
    pub world: usize,
}

impl BucketPlan {
    /// Buckets for parameters of `numels` elements, communicated as `elem_bytes`-byte elements.
    pub fn new(numels: &[usize], elem_bytes: usize, cap_bytes: usize, world: usize) -> BucketPlan {
        let world = world.max(1);
        let cap = (cap_bytes / elem_bytes.max(1)).max(1);
        let mut buckets: Vec<Bucket> = vec![];
        let mut slots = vec![Slot { bucket: 0, offset: 0, numel: 0 }; numels.len()];
        let mut cur = Bucket { params: vec![], len: 0 };
        for p in (0..numels.len()).rev() {
            let n = numels[p];
            let at = cur.len.next_multiple_of(ALIGN);
            if !cur.params.is_empty() && at + n > cap {
                buckets.push(std::mem::replace(&mut cur, Bucket { params: vec![], len: 0 }));
            }
            let at = cur.len.next_multiple_of(ALIGN);
            slots[p] = Slot { bucket: buckets.len(), offset: at, numel: n };
            cur.params.push(p);
            cur.len = at + n;
        }
        if !cur.params.is_empty() {
            buckets.push(cur);
        }
        for b in &mut buckets {
            b.len = b.len.max(1).next_multiple_of(world * ALIGN);
        }
        BucketPlan { buckets, slots, world }
    }

    /// Elements of each rank's shard of bucket `b`.
    pub fn shard_len(&self, b: usize) -> usize {
        self.buckets[b].len / self.world
    }

    /// Total elements over all buckets (padding included).
    pub fn total_len(&self) -> usize {
        self.buckets.iter().map(|b| b.len).sum()
    }

    /// The parts of parameter `p` that fall in shard `rank` of its bucket: (element range inside
    /// the parameter, offset inside the shard).
    pub fn shard_part(&self, p: usize, rank: usize) -> Option<(std::ops::Range<usize>, usize)> {
        let s = &self.slots[p];
        let sl = self.shard_len(s.bucket);
        let (lo, hi) = (rank * sl, (rank + 1) * sl);
        let (a, b) = (s.offset.max(lo), (s.offset + s.numel).min(hi));
        (a < b).then(|| (a - s.offset..b - s.offset, a - lo))
    }
}

/// Counts the gradients still missing per bucket and releases buckets in index order.
#[derive(Debug, Clone)]
pub struct Readiness {
    remaining: Vec<usize>,
    done: Vec<bool>,
    next: usize,
}

impl Readiness {
    pub fn new(plan: &BucketPlan) -> Readiness {
        let remaining: Vec<usize> = plan.buckets.iter().map(|b| b.params.len()).collect();
        Readiness { done: vec![false; plan.slots.len()], remaining, next: 0 }
    }

    /// Parameter `p`'s gradient is in its slot; returns the buckets that may launch now, in order.
    /// A parameter reported twice counts once.
    pub fn param_ready(&mut self, plan: &BucketPlan, p: usize) -> Vec<usize> {
        if !std::mem::replace(&mut self.done[p], true) {
            self.remaining[plan.slots[p].bucket] -= 1;
        }
        self.release()
    }

    fn release(&mut self) -> Vec<usize> {
        let mut out = vec![];
        while self.next < self.remaining.len() && self.remaining[self.next] == 0 {
            out.push(self.next);
            self.next += 1;
        }
        out
    }

    /// Parameters that never got a gradient, and then every bucket not yet released, in order.
    pub fn finish(&mut self) -> (Vec<usize>, Vec<usize>) {
        let missing: Vec<usize> = (0..self.done.len()).filter(|&p| !self.done[p]).collect();
        self.remaining.iter_mut().for_each(|r| *r = 0);
        self.done.iter_mut().for_each(|d| *d = true);
        (missing, self.release())
    }

    /// Buckets released so far.
    pub fn released(&self) -> usize {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_in_reverse_order_up_to_the_cap() {
        // 4-byte elements, cap 1000 elements: params 0..5 of sizes below.
        let numels = [300, 10, 600, 200, 900, 5];
        let plan = BucketPlan::new(&numels, 4, 4000, 2);
        let order: Vec<Vec<usize>> = plan.buckets.iter().map(|b| b.params.clone()).collect();
        // 5 (5) + 4 (at 64: ends at 964 <= 1000); 3 would end at 1224: new bucket with 2 (at 256)
        // and 1 (at 896); 0 (at 960) would end past 1000.
        assert_eq!(order, vec![vec![5, 4], vec![3, 2, 1], vec![0]]);
        for (p, s) in plan.slots.iter().enumerate() {
            assert_eq!(s.offset % ALIGN, 0);
            assert_eq!(s.numel, numels[p]);
            assert!(s.offset + s.numel <= plan.buckets[s.bucket].len);
        }
        // Slots of one bucket never overlap.
        for b in &plan.buckets {
            let mut spans: Vec<(usize, usize)> =
                b.params.iter().map(|&p| (plan.slots[p].offset, plan.slots[p].offset + numels[p])).collect();
            spans.sort();
            assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
            assert_eq!(b.len % (2 * ALIGN), 0);
        }
    }

    #[test]
    fn a_parameter_larger_than_the_cap_gets_its_own_bucket() {
        let plan = BucketPlan::new(&[10, 5000, 10], 4, 400, 1);
        let order: Vec<Vec<usize>> = plan.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(order, vec![vec![2], vec![1], vec![0]]);
        // bf16 halves the bytes: more parameters per bucket.
        let f32 = BucketPlan::new(&[100; 8], 4, 1024, 1);
        let bf16 = BucketPlan::new(&[100; 8], 2, 1024, 1);
        assert!(bf16.buckets.len() < f32.buckets.len());
    }

    #[test]
    fn buckets_release_in_index_order_whatever_order_gradients_finish() {
        let plan = BucketPlan::new(&[100, 100, 100, 100], 4, 400, 1);
        assert_eq!(plan.buckets.len(), 4, "one parameter per bucket: {plan:?}");
        // Bucket 0 holds parameter 3, bucket 3 parameter 0.
        let mut r = Readiness::new(&plan);
        assert_eq!(r.param_ready(&plan, 2), Vec::<usize>::new(), "bucket 1 must wait for bucket 0");
        assert_eq!(r.param_ready(&plan, 2), Vec::<usize>::new(), "a repeat counts once");
        assert_eq!(r.param_ready(&plan, 3), vec![0, 1]);
        assert_eq!(r.param_ready(&plan, 0), Vec::<usize>::new());
        assert_eq!(r.released(), 2);
        let (missing, rest) = r.finish();
        assert_eq!((missing, rest), (vec![1], vec![2, 3]));
    }

    #[test]
    fn shards_cover_every_parameter_element_exactly_once() {
        let numels = [37, 129, 1, 64, 500, 3];
        for world in 1..=4 {
            let plan = BucketPlan::new(&numels, 4, 1200, world);
            for (p, &n) in numels.iter().enumerate() {
                let mut covered = vec![0u8; n];
                for rank in 0..world {
                    if let Some((range, at)) = plan.shard_part(p, rank) {
                        assert!(at + range.len() <= plan.shard_len(plan.slots[p].bucket));
                        range.for_each(|i| covered[i] += 1);
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "world {world}, param {p}: {covered:?}");
            }
        }
    }
}
