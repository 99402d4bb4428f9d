//! Who this process is in the job, read from the variables the launchers set:
//!
//! - `ferrograd launch` and torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (`LOCAL_WORLD_SIZE`),
//!   `MASTER_ADDR`, `MASTER_PORT`;
//! - Slurm (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`; `MASTER_ADDR` must be set
//!   by the job script (Slurm has no such variable), `MASTER_PORT` defaults to 29500.
//!
//! `FERROGRAD_DIST_TIMEOUT` (seconds, default 300) bounds the rendezvous and every wait on a peer.
//! Under torchrun, its own store already listens on `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE`),
//! so rank 0 serves the NCCL id on `MASTER_PORT + 1`; `FERROGRAD_RDZV_PORT` overrides either.

use crate::error::{DistError, DistResult};
use std::time::Duration;

pub const DEFAULT_PORT: u16 = 29500;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `ferrograd launch` (it also sets `FERROGRAD_LAUNCH=1`).
    Ferrograd,
    /// torchrun / torch.distributed.run (`TORCHELASTIC_RUN_ID` is set).
    Torchrun,
    Slurm,
    /// `RANK`/`WORLD_SIZE` set by hand or by another launcher.
    Env,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Index of this process among those of its node: the GPU it uses.
    pub local_rank: usize,
    pub local_world_size: Option<usize>,
    pub master_addr: String,
    pub master_port: u16,
    /// Where rank 0 serves the NCCL id (usually `master_port`).
    pub rendezvous_port: u16,
    pub timeout: Duration,
    pub launcher: Launcher,
}

fn env_err(var: &'static str, value: &str, msg: impl Into<String>) -> DistError {
    DistError::Env { var, value: value.to_string(), msg: msg.into() }
}

fn parse<T: std::str::FromStr>(var: &'static str, v: &str, what: &str) -> DistResult<T> {
    v.trim().parse().map_err(|_| env_err(var, v, format!("expected {what}")))
}

impl DistEnv {
    /// From this process's environment; `None` when no launcher variables are set (a single
    /// process, world size 1).
    pub fn from_env() -> DistResult<Option<DistEnv>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// From any variable lookup (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> DistResult<Option<DistEnv>> {
        let timeout = match get("FERROGRAD_DIST_TIMEOUT") {
            None => DEFAULT_TIMEOUT,
            Some(v) => {
                let s: f64 = parse("FERROGRAD_DIST_TIMEOUT", &v, "a number of seconds")?;
                if !(s > 0.0 && s.is_finite()) {
                    return Err(env_err("FERROGRAD_DIST_TIMEOUT", &v, "expected a positive number of seconds"));
                }
                Duration::from_secs_f64(s)
            }
        };
        let (rank, world_size, local_rank, local_world_size, launcher) = if get("RANK").is_some()
            || get("WORLD_SIZE").is_some()
        {
            let need = |k: &'static str| {
                get(k).ok_or_else(|| {
                    env_err(k, "", "not set, but RANK or WORLD_SIZE is: set all of RANK, WORLD_SIZE and LOCAL_RANK")
                })
            };
            let rank: usize = parse("RANK", &need("RANK")?, "a rank (0, 1, ...)")?;
            let world: usize = parse("WORLD_SIZE", &need("WORLD_SIZE")?, "the number of processes")?;
            if world == 0 {
                return Err(env_err("WORLD_SIZE", "0", "the world size must be at least 1"));
            }
            let local = match get("LOCAL_RANK") {
                Some(v) => parse("LOCAL_RANK", &v, "this process's GPU index on its node")?,
                None if world == 1 => 0,
                None => {
                    return Err(env_err("LOCAL_RANK", "", "not set: set it to this process's GPU index on its node"))
                }
            };
            let lw = match get("LOCAL_WORLD_SIZE") {
                Some(v) => Some(parse("LOCAL_WORLD_SIZE", &v, "the number of processes on this node")?),
                None => None,
            };
            let launcher = if get("FERROGRAD_LAUNCH").as_deref() == Some("1") {
                Launcher::Ferrograd
            } else if get("TORCHELASTIC_RUN_ID").is_some() {
                Launcher::Torchrun
            } else {
                Launcher::Env
            };
            (rank, world, local, lw, launcher)
        } else if let Some(p) = get("SLURM_PROCID") {
            let rank: usize = parse("SLURM_PROCID", &p, "a rank")?;
            let n = get("SLURM_NTASKS").ok_or_else(|| env_err("SLURM_NTASKS", "", "not set, but SLURM_PROCID is"))?;
            let world: usize = parse("SLURM_NTASKS", &n, "the number of tasks")?;
            let local = match get("SLURM_LOCALID") {
                Some(v) => parse("SLURM_LOCALID", &v, "the task's index on its node")?,
                None => 0,
            };
            let lw = match get("SLURM_NTASKS_PER_NODE") {
                Some(v) => v.trim().parse().ok(),
                None => None,
            };
            (rank, world, local, lw, Launcher::Slurm)
        } else {
            return Ok(None);
        };
        if world_size == 0 {
            return Err(env_err("SLURM_NTASKS", "0", "the world size must be at least 1"));
        }
        if rank >= world_size {
            return Err(env_err("RANK", &rank.to_string(), format!("must be below WORLD_SIZE={world_size}")));
        }
        if let Some(lw) = local_world_size {
            if local_rank >= lw {
                return Err(env_err(
                    "LOCAL_RANK",
                    &local_rank.to_string(),
                    format!("must be below LOCAL_WORLD_SIZE={lw}"),
                ));
            }
        }
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            _ if world_size == 1 => "127.0.0.1".to_string(),
            _ => {
                let hint = if launcher == Launcher::Slurm {
                    "set it in the job script to the first node's host name, e.g. \
                     export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)"
                } else {
                    "set it to the host name or address of rank 0's node"
                };
                return Err(env_err("MASTER_ADDR", "", format!("not set; {hint}")));
            }
        };
        let master_port: u16 = match get("MASTER_PORT") {
            Some(v) => parse("MASTER_PORT", &v, "a TCP port (1-65535)")?,
            None => DEFAULT_PORT,
        };
        if master_port == 0 {
            return Err(env_err("MASTER_PORT", "0", "expected a TCP port (1-65535)"));
        }
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let rendezvous_port = match get("FERROGRAD_RDZV_PORT") {
            Some(v) => parse("FERROGRAD_RDZV_PORT", &v, "a TCP port (1-65535)")?,
            None if agent_store => master_port.checked_add(1).ok_or_else(|| {
                env_err("MASTER_PORT", "65535", "torchrun's store holds MASTER_PORT and there is no port above it")
            })?,
            None => master_port,
        };
        Ok(Some(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            rendezvous_port,
            timeout,
            launcher,
        }))
    }

    /// `host:port` where rank 0 serves the NCCL id.
    pub fn rendezvous_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.rendezvous_port)
        } else {
            format!("{}:{}", self.master_addr, self.rendezvous_port)
        }
    }
}

/// `FERROGRAD_DIST_TIMEOUT` (or its default) for code that has no `DistEnv` at hand; a bad value
/// is reported by `DistEnv::from_env`, here it falls back to the default.
pub fn timeout_from_env() -> Duration {
    std::env::var("FERROGRAD_DIST_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0 && s.is_finite())
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> DistResult<Option<DistEnv>> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn no_variables_is_a_single_process() {
        assert_eq!(env(&[]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
            ("TORCHELASTIC_RUN_ID", "x"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("FERROGRAD_DIST_TIMEOUT", "2.5"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (3, 4, 1, Some(2)));
        assert_eq!((e.master_addr.as_str(), e.master_port, e.rendezvous_port), ("node0", 1234, 1235));
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!(e.timeout, Duration::from_millis(2500));
        assert_eq!(e.rendezvous_addr(), "node0:1235");
    }

    #[test]
    fn slurm_variables_need_master_addr() {
        let base = [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")];
        let err = env(&base).unwrap_err().to_string();
        assert!(err.contains("MASTER_ADDR") && err.contains("scontrol"), "{err}");
        let mut with = base.to_vec();
        with.push(("MASTER_ADDR", "10.0.0.1"));
        let e = env(&with).unwrap().unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.master_port), (5, 8, 1, DEFAULT_PORT));
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!(e.timeout, DEFAULT_TIMEOUT);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "0")], "WORLD_SIZE"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "a")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a")], "LOCAL_RANK"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT",
            ),
            (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("FERROGRAD_DIST_TIMEOUT", "-1")], "FERROGRAD_DIST_TIMEOUT"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
        ];
        for (pairs, var) in cases {
            let err = env(pairs).unwrap_err();
            assert!(matches!(&err, DistError::Env { var: v, .. } if v == var), "{pairs:?}: {err}");
        }
    }

    #[test]
    fn world_of_one_needs_no_master() {
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap().unwrap();
        assert_eq!((e.local_rank, e.master_addr.as_str()), (0, "127.0.0.1"));
        let v6 = DistEnv { master_addr: "::1".into(), ..e };
        assert_eq!(v6.rendezvous_addr(), "[::1]:29500");
    }
}
