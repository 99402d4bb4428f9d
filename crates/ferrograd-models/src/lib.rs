//! Models and workloads built on ferrograd. `monster_walk` is the first end-to-end workload
//! (see `docs/monster-walk.md`).

pub mod monster_walk;
pub mod persistent;
