//! Where everything lives for the persistent kernel (`kernels/mlp_persistent.cu`): the padded
//! weight layout shared by shared memory and the global `params` buffer, the shared-memory plan
//! of one block, and the descriptor the kernel reads. Pure arithmetic, tested on the CPU.

use crate::persistent::MlpSpec;

/// Threads per block and warps per block (the kernel's MLP_THREADS / MLP_WARPS).
pub const THREADS: usize = 512;
pub const WARPS: usize = 16;
/// The warps that reduce region A during the last phase (the kernel's MLP_RWARPS).
pub const RWARPS: usize = 6;
/// u32 words between grid-barrier counters (the kernel's MLP_BAR_STRIDE: 128 bytes, one L2 line
/// each) and the counters' buffer: barriers B and 2, then barrier A of each reducer warp.
pub const BAR_STRIDE: usize = 32;
pub const BAR_WORDS: usize = BAR_STRIDE * (1 + RWARPS);
/// The kernel's MLP_MAX_LAYERS and the widest layer it handles (8 tiles of 16 outputs).
pub const MAX_LAYERS: usize = 16;
pub const MAX_WIDTH: usize = 128;

/// One layer as the kernel sees it (`struct MlpLayer`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerDesc {
    pub inp: i32,
    pub out: i32,
    pub ks_in: i32,
    pub ks_out: i32,
    pub woff: i32,
    pub aoff: i32,
    pub doff: i32,
    pub relu: i32,
}

/// The kernel's `struct MlpDesc`; every field is 32 bits, so the C and Rust layouts agree.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    pub layers: i32,
    pub pp: i32,
    pub pstride: i32,
    pub rows_cap: i32,
    pub slice_a: i32,
    /// Unused (region A is reduced in registers); keeps the descriptor at 144 words, so that
    /// the weights after it start 16-byte aligned.
    pub unused: i32,
    pub w_base: i32,
    pub a0_off0: i32,
    pub a0_off1: i32,
    pub red_off: i32,
    pub adam_off: i32,
    pub wloss_off: i32,
    pub smem_floats: i32,
    pub dw_items: i32,
    pub slice_b: i32,
    pub ngroups_b: i32,
    pub l: [LayerDesc; MAX_LAYERS],
}

/// Floats the descriptor takes at the start of shared memory (the kernel's MLP_DESC_FLOATS).
pub const DESC_FLOATS: usize = std::mem::size_of::<Desc>() / 4;

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// Row stride of a `width`-feature buffer: room for the features and the ones (bias) column,
/// padded to 8, plus 4 so that the stride is 4 mod 8 and fragment loads are bank-conflict free.
pub fn ks(width: usize) -> usize {
    round_up(width + 1, 8) + 4
}

/// The whole plan for one spec, grid and row capacity.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub desc: Desc,
    pub grid: usize,
    pub rows_cap: usize,
    pub smem_bytes: usize,
    /// Floats of the padded parameter vector (global `params`, one partial row, W in smem).
    pub pp: usize,
    /// (in, out, offset of W_l) per layer, for packing.
    layers: Vec<(usize, usize, usize)>,
}

impl Layout {
    /// Plan `spec` for `grid` blocks holding at most `rows_cap` rows each (a multiple of 8).
    pub fn new(spec: &MlpSpec, grid: usize, rows_cap: usize) -> Layout {
        let w = spec.widths();
        let nl = w.len() - 1;
        let rows_cap = round_up(rows_cap.max(8), 8);
        let grid = grid.max(1);
        let mut d = Desc { layers: nl as i32, rows_cap: rows_cap as i32, ..Desc::default() };
        let mut layers = Vec::with_capacity(nl);
        let mut woff = 0usize;
        for l in 0..nl {
            let (inp, out) = (w[l], w[l + 1]);
            d.l[l] = LayerDesc {
                inp: inp as i32,
                out: out as i32,
                ks_in: ks(inp) as i32,
                ks_out: ks(out) as i32,
                woff: woff as i32,
                relu: spec.relu()[l] as i32,
                ..LayerDesc::default()
            };
            layers.push((inp, out, woff));
            woff += round_up(out, 8) * ks(inp);
        }
        let pp = woff;
        // Fragment loads may run up to 8 rows (W, forward) or 12 columns (W^T, D) past a buffer.
        let slack = round_up(8 * w.iter().map(|&x| ks(x)).max().unwrap_or(8) + 16, 4);
        let mut off = DESC_FLOATS;
        d.w_base = off as i32;
        off += round_up(pp + slack, 4);
        d.a0_off0 = off as i32;
        off += rows_cap * ks(w[0]);
        d.a0_off1 = off as i32;
        off += rows_cap * ks(w[0]);
        for (ly, &width) in d.l.iter_mut().zip(w).take(nl).skip(1) {
            ly.aoff = off as i32;
            off += rows_cap * ks(width);
        }
        for (ly, &width) in d.l.iter_mut().zip(&w[1..]) {
            ly.doff = off as i32;
            off += rows_cap * ks(width);
        }
        off += slack;
        // The reduce-scatter in two regions of the gradient row: B = W_0 (reduced last, by all
        // threads, row groups summed through shared memory) and A = every other layer and the
        // loss sum at index pp (reduced in registers by RWARPS warps while W_0's gradients are
        // computed). One slice of each per block.
        let w1 = layers.get(1).map_or(pp, |l| l.2);
        let slice_a = round_up((pp + 4 - w1).div_ceil(grid), 4);
        let slice_b = round_up(w1.div_ceil(grid), 4);
        // Region B's row groups: as many as the threads allow, but no more than 8 partial rows a
        // group apart (a thread's loads are all in flight at once; the Adam thread sums the groups).
        let ngroups_b = (THREADS / (slice_b / 4)).clamp(1, grid.div_ceil(8).max(1));
        d.red_off = off as i32;
        off += ngroups_b * slice_b;
        d.adam_off = off as i32;
        off += 3 * (slice_a + slice_b);
        d.wloss_off = off as i32;
        off += round_up(WARPS, 4);
        let smem_floats = round_up(off, 4);
        d.pp = pp as i32;
        // Partial rows start on 128-byte lines, so every slice of a row touches the fewest sectors.
        d.pstride = round_up(pp + 4, 32) as i32;
        d.slice_a = slice_a as i32;
        d.slice_b = slice_b as i32;
        d.ngroups_b = ngroups_b as i32;
        d.smem_floats = smem_floats as i32;
        d.dw_items =
            (0..nl).map(|l| w[l + 1].div_ceil(16) * ((w[l] + 1).div_ceil(8)).div_ceil(3)).sum::<usize>() as i32;
        Layout { desc: d, grid, rows_cap, smem_bytes: smem_floats * 4, pp, layers }
    }

    /// The descriptor as the i32 words the kernel copies into shared memory.
    pub fn desc_words(&self) -> Vec<i32> {
        let d = &self.desc;
        let mut v = vec![
            d.layers,
            d.pp,
            d.pstride,
            d.rows_cap,
            d.slice_a,
            d.unused,
            d.w_base,
            d.a0_off0,
            d.a0_off1,
            d.red_off,
            d.adam_off,
            d.wloss_off,
            d.smem_floats,
            d.dw_items,
            d.slice_b,
            d.ngroups_b,
        ];
        for l in &d.l {
            v.extend([l.inp, l.out, l.ks_in, l.ks_out, l.woff, l.aoff, l.doff, l.relu]);
        }
        v
    }

    /// Floats of one block's partial-gradient row (the padded parameters and the loss sum).
    pub fn pstride(&self) -> usize {
        self.desc.pstride as usize
    }

    /// Pack per-layer (W `[out][in]` row-major, b `[out]`) into the padded layout: layer l is
    /// `[round_up(out, 8)][ks(in)]` with the bias as column `in` and zeros elsewhere.
    pub fn pack(&self, weights: &[(Vec<f32>, Vec<f32>)]) -> Vec<f32> {
        let mut p = vec![0.0f32; self.pp];
        for (&(inp, out, woff), (w, b)) in self.layers.iter().zip(weights) {
            let k = ks(inp);
            for j in 0..out {
                p[woff + j * k..woff + j * k + inp].copy_from_slice(&w[j * inp..(j + 1) * inp]);
                p[woff + j * k + inp] = b[j];
            }
        }
        p
    }

    /// The inverse of [`Layout::pack`].
    pub fn unpack(&self, p: &[f32]) -> Vec<(Vec<f32>, Vec<f32>)> {
        self.layers
            .iter()
            .map(|&(inp, out, woff)| {
                let k = ks(inp);
                let mut w = Vec::with_capacity(out * inp);
                let mut b = Vec::with_capacity(out);
                for j in 0..out {
                    w.extend_from_slice(&p[woff + j * k..woff + j * k + inp]);
                    b.push(p[woff + j * k + inp]);
                }
                (w, b)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn monster() -> MlpSpec {
        MlpSpec::new(vec![71, 47, 23, 11, 5, 11, 23, 47, 71], vec![true, true, true, true, true, true, true, false])
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn monster_walk_plan() {
        let l = Layout::new(&monster(), 132, 40);
        // 9,690 parameters padded to 11,264 (rows to 8, strides to 4 mod 8 with the bias column).
        assert_eq!(l.pp, 11_264);
        assert_eq!(DESC_FLOATS, 144);
        // Region B (W_0: 48 x 76 floats) and region A (the rest and the loss column), per block.
        assert_eq!((l.desc.slice_a, l.desc.slice_b, l.desc.ngroups_b), (60, 28, 17));
        assert_eq!(l.desc.pstride, 11_296);
        assert_eq!(l.desc.dw_items, 31);
        assert_eq!(l.smem_bytes, 39_492 * 4);
        assert!(132 * l.desc.slice_b as usize >= 3_648 && 132 * l.desc.slice_a as usize >= l.pp + 4 - 3_648);
        assert!(l.smem_bytes <= 227 * 1024);
        assert_eq!(l.desc_words().len(), DESC_FLOATS);
        // Every offset is 16-byte aligned and every stride is 4 mod 8.
        let d = &l.desc;
        for o in [d.w_base, d.a0_off0, d.a0_off1, d.red_off, d.adam_off, d.wloss_off, d.smem_floats] {
            assert_eq!(o % 4, 0);
        }
        for ly in &d.l[..8] {
            assert_eq!((ly.ks_in % 8, ly.ks_out % 8, ly.woff % 4, ly.aoff % 4, ly.doff % 4), (4, 4, 0, 0, 0));
        }
    }

    #[test]
    fn pack_unpack_round_trip() {
        let spec = MlpSpec::new(vec![5, 128, 3, 9], vec![true, false, true]).unwrap_or_else(|e| panic!("{e}"));
        let l = Layout::new(&spec, 7, 16);
        let mut k = 0.0f32;
        let mut next = || {
            k += 1.0;
            k
        };
        let w: Vec<(Vec<f32>, Vec<f32>)> = [(5, 128), (128, 3), (3, 9)]
            .iter()
            .map(|&(i, o)| ((0..i * o).map(|_| next()).collect(), (0..o).map(|_| next()).collect()))
            .collect();
        let p = l.pack(&w);
        assert_eq!(p.len(), l.pp);
        assert_eq!(l.unpack(&p), w);
        // Exactly the real parameters are non-zero; the bias sits in column `in`.
        assert_eq!(p.iter().filter(|&&x| x != 0.0).count(), spec.parameter_count());
        assert_eq!(p[5], w[0].1[0]);
        assert_eq!(p[ks(5)], w[0].0[5]);
    }
}
