//! Models and workloads built on ferrograd. `monster_walk` is the first end-to-end workload
//! (see `docs/monster-walk.md`); `gpt` is GPT-2 trained on real text.

pub mod gpt;
pub mod monster_walk;
pub mod persistent;
