//! What the row-wise fused ops (softmax, layer norm, cross entropy) share: the rows of a layout
//! over its last dim, and how much shared memory a row cache may take.

use crate::Layout;

/// (rows, cols) of a layout read as rows of its last dim (a 0-d layout is one row of one).
pub(crate) fn last_dim_rows(l: &Layout) -> (usize, usize) {
    let cols = l.dims().last().copied().unwrap_or(1);
    (l.elem_count().checked_div(cols).unwrap_or(0), cols)
}

/// Dynamic shared memory for a kernel that caches one row of `cols` accumulators: the row, when it
/// fits in the 48 KiB a launch gets without opting in; else 0 (the kernel re-reads the row).
pub(crate) fn row_cache_bytes(cols: usize, acc_bytes: usize) -> u32 {
    const MAX_ROW_SMEM: usize = 48 * 1024;
    let bytes = cols * acc_bytes;
    if bytes <= MAX_ROW_SMEM {
        bytes as u32
    } else {
        0
    }
}
