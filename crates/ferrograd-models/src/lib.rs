//! Models and workloads built on ferrograd. `monster_walk` is the first end-to-end workload
//! (see `shared/MONSTER_WALK.md`).

pub mod monster_walk;
pub mod persistent;
