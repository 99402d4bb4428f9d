//! The graphs' descriptors against a real libcudnn where one loads without a GPU
//! (`FERROGRAD_CUDNN_LIBRARY=.../libcudnn.so.9`): every tensor and operation finalizes, and so does
//! the operation graph (cuDNN 9.14+ finalizes one without a handle). Skipped, with a line, where
//! no cuDNN loads. Whether an engine takes the graph needs a GPU (tests/core_suite/attention.rs).

use super::graph::{Builder, Shape};
use super::library;
use cudarc::cudnn::sys::cudnnDataType_t;

fn cases() -> Vec<(Shape, [[i64; 4]; 3])> {
    let (b, h, t, d) = (2i64, 3i64, 129i64, 64i64);
    // q, k, v as views of one [B, T, 3, H, D] buffer.
    let s = [t * 3 * h * d, d, 3 * h * d, 1];
    let mut out = vec![];
    for causal in [false, true] {
        for io in [cudnnDataType_t::CUDNN_DATA_BFLOAT16, cudnnDataType_t::CUDNN_DATA_HALF] {
            out.push((Shape { b, h, tq: t, tk: t, d, io: io as u32, causal }, [s, s, s]));
        }
    }
    out
}

#[test]
fn sdpa_graphs_finalize() {
    let lib = match library() {
        Ok(l) => l,
        Err(e) => {
            println!("skipping: {e}");
            return;
        }
    };
    if lib.version < 91400 {
        println!("skipping: cuDNN {} finalizes operation graphs only with a handle (a GPU)", lib.version_string());
        return;
    }
    for (sh, [q, k, v]) in cases() {
        let o = [sh.tq * sh.h * sh.d, sh.d, sh.h * sh.d, 1];
        let mut g = Builder::new(lib);
        g.sdpa_forward(&sh, q, k, v, o).expect("forward graph");
        g.operation_graph(None).unwrap_or_else(|e| panic!("forward {sh:?}: {e}"));
        for padded in [false, true] {
            let mut g = Builder::new(lib);
            g.sdpa_backward(&sh, padded, q, k, v, o, o, o, o, o).expect("backward graph");
            g.operation_graph(None).unwrap_or_else(|e| panic!("backward {sh:?} padded={padded}: {e}"));
        }
    }
}
