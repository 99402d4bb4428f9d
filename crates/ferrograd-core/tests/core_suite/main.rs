//! ferrograd-core's integration tests, one binary (one link) with a module per file; the backend suite
//! (`backend_tests!`) and the CUDA tests beside the CPU ones, which skip with one printed line
//! when no GPU is usable. Files that change process-wide state (poisoning off, the matmul
//! precision, the sticky device-error flag, sync counters) stay binaries of their own in `tests/`.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod adam_paths;
mod add_layer_norm;
mod attention;
mod attention_cudnn;
mod attention_packed;
mod backward_hook;
mod bias_gelu;
mod classifier;
mod clip;
mod conv1d_causal;
mod copy_paths;
mod cuda_clusters;
mod cuda_graph;
mod cuda_parity;
mod dtypes;
mod errors;
mod fake_quantize;
mod gradcheck;
mod io;
mod layer_norm_mixed;
mod linear;
mod linear_master;
mod mlp;
mod mse_loss;
mod nan;
mod predictor;
mod props;
mod quant_int8;
mod robust_ops;
mod selective_scan;
mod shadow;
mod sizes;
mod smoke;
mod unary_paths;
