//! ferrograd-dist's integration tests, one binary (one link) with a module per file.

mod comm;
mod dp;
mod pipeline;
