//! `ferrograd launch`: one process per GPU, torchrun-style.
//!
//! Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT` and `FERROGRAD_LAUNCH=1` (plus `NCCL_NVLS_ENABLE=0`
//! unless set: NVLink multicast is off unless asked for). A command named `ferrograd` runs this very
//! binary. Every output line of a child is prefixed with its rank (`[rank 3] ...`) on the stream it
//! was written to.
//!
//! Children run in process groups of their own, so that signals reach whatever they started:
//! SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 sent to the launcher are forwarded to every rank.
//! When a rank fails (non-zero exit or a signal) while others still run, the launcher says which,
//! sends SIGTERM to the others, SIGKILL after `--stop-grace` seconds, and exits with an error: a
//! rank blocked in a collective with a dead peer never hangs the job.

use crate::CliResult;
use clap::Args;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes to start on this node, one per GPU: a number, or `gpu` for every visible GPU.
    #[arg(long)]
    pub nproc_per_node: String,
    /// Nodes in the job (run one `ferrograd launch` per node).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, 0 to nnodes - 1 (node 0 hosts rank 0).
    #[arg(long, value_parser = crate::parse_count, default_value_t = 0)]
    pub node_rank: usize,
    /// Host name or address of node 0 (default 127.0.0.1 on one node; required for several).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// TCP port where rank 0 serves the rendezvous.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Seconds the other ranks get to exit after one failed (or after a forwarded signal) before
    /// they are killed.
    #[arg(long, default_value_t = 5.0)]
    pub stop_grace: f64,
    /// The program to run in every process and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// The signal the launcher received last (0: none), set by the handler.
static PENDING: AtomicI32 = AtomicI32::new(0);
const FORWARDED: [libc::c_int; 5] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1, libc::SIGUSR2];

extern "C" fn on_signal(sig: libc::c_int) {
    // An atomic store is async-signal-safe; the monitor loop does the rest.
    PENDING.store(sig, Ordering::SeqCst);
}

fn install_handlers() -> CliResult<()> {
    for sig in FORWARDED {
        // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid; the handler
        // only stores to an atomic.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(
                format!("cannot install a handler for signal {sig}: {}", std::io::Error::last_os_error()).into()
            );
        }
    }
    Ok(())
}

pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        _ => return format!("signal {sig}"),
    };
    format!("signal {sig} ({name})")
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by {}", signal_name(s)),
        _ => format!("ended ({status})"),
    }
}

/// One started rank.
struct Rank {
    rank: usize,
    local: usize,
    child: Child,
    status: Option<ExitStatus>,
}

impl Rank {
    fn signal(&self, sig: libc::c_int) {
        if self.status.is_none() {
            // SAFETY: plain kill(2) on the child's process group (it leads its own group).
            unsafe { libc::kill(-(self.child.id() as libc::pid_t), sig) };
        }
    }
}

/// A line a rank wrote, already prefixed, and whether it went to stderr.
type Line = (bool, Vec<u8>);

/// Read `src` line by line and send each, prefixed with `prefix`, to the launcher's main thread
/// (which owns stdout; `main` holds its lock for the whole command).
fn pump(
    src: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    tx: Sender<Line>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(format!("launch-out-{prefix}")).spawn(move || {
        let mut r = BufReader::new(src);
        loop {
            let mut line = prefix.clone().into_bytes();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if line.last() != Some(&b'\n') {
                        line.push(b'\n');
                    }
                    if tx.send((to_stderr, line)).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

/// Write what the ranks printed so far. Write errors (a closed pipe) are ignored: the ranks keep
/// running and are still supervised.
fn drain(rx: &Receiver<Line>, out: &mut dyn Write, wait: Option<Duration>) -> bool {
    let mut got = false;
    loop {
        let next = match wait {
            Some(d) if !got => rx.recv_timeout(d).ok(),
            _ => rx.try_recv().ok(),
        };
        let Some((to_stderr, line)) = next else { break };
        got = true;
        let _ = if to_stderr { std::io::stderr().write_all(&line) } else { out.write_all(&line) };
    }
    let _ = out.flush();
    got
}

/// Processes per node at most: one per GPU, far above any node's count, and a bound on what a typo
/// can start.
const MAX_PER_NODE: usize = 1024;

/// `--nproc-per-node` as written: a count, or `None` for every visible GPU (`gpu`, `auto`).
fn nproc_spec(spec: &str) -> CliResult<Option<usize>> {
    if spec.eq_ignore_ascii_case("gpu") || spec.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    match crate::parse_count(spec) {
        Ok(n) if (1..=MAX_PER_NODE).contains(&n) => Ok(Some(n)),
        Ok(n) => Err(format!("--nproc-per-node {n}: expected 1 to {MAX_PER_NODE} processes (one per GPU)").into()),
        Err(e) => Err(format!("--nproc-per-node {spec:?}: {e}, or `gpu` for every visible GPU").into()),
    }
}

/// The processes to start on this node (`gpu` asks the driver how many GPUs it sees).
fn nproc(spec: &str) -> CliResult<usize> {
    match nproc_spec(spec)? {
        Some(n) => Ok(n),
        None => match ferrograd_core::cuda::device_count().unwrap_or(0) {
            0 => Err("--nproc-per-node gpu: no CUDA device is visible".into()),
            n => Ok(n),
        },
    }
}

/// The flags, before anything starts (no device is asked, nothing is spawned): counts, ranks,
/// the port, the grace period, the address several nodes need, and a command.
pub fn check(a: &LaunchArgs) -> CliResult<()> {
    let per_node = nproc_spec(&a.nproc_per_node)?;
    if a.nnodes == 0 {
        return Err("--nnodes must be at least 1".into());
    }
    if let Some(n) = per_node {
        n.checked_mul(a.nnodes).ok_or("--nproc-per-node times --nnodes overflows")?;
    }
    if a.node_rank >= a.nnodes {
        return Err(format!("--node-rank {} must be below --nnodes {}", a.node_rank, a.nnodes).into());
    }
    if a.master_port == 0 {
        return Err("--master-port must be a TCP port (1-65535)".into());
    }
    if !(a.stop_grace >= 0.0 && a.stop_grace.is_finite()) {
        return Err(format!("--stop-grace {} must be a number of seconds", a.stop_grace).into());
    }
    if a.master_addr.is_none() && a.nnodes > 1 {
        return Err("--master-addr is required with --nnodes above 1: node 0's host name or address".into());
    }
    if a.command.first().is_none_or(|p| p.is_empty()) {
        return Err("no command given after --".into());
    }
    Ok(())
}

fn ranges(ranks: &[usize]) -> String {
    ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

/// Start the ranks and supervise them (after [`check`]).
pub fn run(a: LaunchArgs, out: &mut dyn Write) -> CliResult<()> {
    let per_node = nproc(&a.nproc_per_node)?;
    let master = a.master_addr.clone().unwrap_or_else(|| "127.0.0.1".to_string());
    let world = per_node.checked_mul(a.nnodes).ok_or("--nproc-per-node times --nnodes overflows")?;
    let (prog, args) = a.command.split_first().ok_or("no command given after --")?;
    let exe = if prog == "ferrograd" { std::env::current_exe()? } else { prog.into() };
    install_handlers()?;
    out.flush()?;

    let mut ranks: Vec<Rank> = vec![];
    let mut pumps: Vec<JoinHandle<()>> = vec![];
    let (tx, rx) = channel::<Line>();
    for local in 0..per_node {
        let rank = a.node_rank * per_node + local;
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", per_node.to_string())
            .env("GROUP_RANK", a.node_rank.to_string())
            .env("NODE_RANK", a.node_rank.to_string())
            .env("MASTER_ADDR", &master)
            .env("MASTER_PORT", a.master_port.to_string())
            .env("FERROGRAD_LAUNCH", "1")
            .env_remove("TORCHELASTIC_RUN_ID")
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .stdin(if local == 0 { Stdio::inherit() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        match cmd.spawn() {
            Ok(mut child) => {
                let prefix = format!("[rank {rank}] ");
                if let Some(o) = child.stdout.take() {
                    pumps.push(pump(o, prefix.clone(), false, tx.clone())?);
                }
                if let Some(e) = child.stderr.take() {
                    pumps.push(pump(e, prefix, true, tx.clone())?);
                }
                ranks.push(Rank { rank, local, child, status: None });
            }
            Err(e) => {
                for r in &mut ranks {
                    r.signal(libc::SIGKILL);
                    let _ = r.child.wait();
                }
                return Err(format!("cannot start {} for rank {rank}: {e}", exe.display()).into());
            }
        }
    }

    let grace = Duration::from_secs_f64(a.stop_grace);
    let mut failure: Option<String> = None;
    let mut interrupted: Option<i32> = None;
    let mut stop_since: Option<Instant> = None;
    let mut killed = false;
    while ranks.iter().any(|r| r.status.is_none()) {
        let sig = PENDING.swap(0, Ordering::SeqCst);
        if sig != 0 {
            // A second interrupt while stopping means "now".
            let now = if interrupted.is_some() && sig == libc::SIGINT { libc::SIGKILL } else { sig };
            ranks.iter().for_each(|r| r.signal(now));
            if matches!(sig, libc::SIGINT | libc::SIGTERM | libc::SIGHUP) {
                interrupted.get_or_insert(sig);
                stop_since.get_or_insert_with(Instant::now);
            }
        }
        for i in 0..ranks.len() {
            if ranks[i].status.is_some() {
                continue;
            }
            let Some(st) = ranks[i].child.try_wait()? else { continue };
            ranks[i].status = Some(st);
            if st.success() || failure.is_some() || interrupted.is_some() {
                continue;
            }
            let r = &ranks[i];
            let others: Vec<usize> = ranks.iter().filter(|o| o.status.is_none()).map(|o| o.rank).collect();
            let msg = format!("rank {} (local rank {}, pid {}) {}", r.rank, r.local, r.child.id(), describe(st));
            if others.is_empty() {
                eprintln!("ferrograd launch: {msg}");
            } else {
                eprintln!(
                    "ferrograd launch: {msg}; stopping rank(s) {} (SIGTERM, then SIGKILL after {:.0} s)",
                    ranges(&others),
                    grace.as_secs_f64()
                );
            }
            failure = Some(msg);
            ranks.iter().for_each(|o| o.signal(libc::SIGTERM));
            stop_since = Some(Instant::now());
        }
        if let (Some(t), false) = (stop_since, killed) {
            if t.elapsed() > grace {
                ranks.iter().for_each(|r| r.signal(libc::SIGKILL));
                killed = true;
            }
        }
        drain(&rx, out, Some(Duration::from_millis(20)));
    }
    drop(tx);
    if failure.is_some() || interrupted.is_some() {
        // Whatever the ranks started in their process groups goes too.
        for r in &ranks {
            // SAFETY: kill(2) on a process group that may be empty (ESRCH is fine).
            unsafe { libc::kill(-(r.child.id() as libc::pid_t), libc::SIGKILL) };
        }
    }
    // Output still in the pipes; a grandchild holding a pipe open is not waited for long.
    let deadline = Instant::now() + Duration::from_secs(2);
    while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < deadline {
        drain(&rx, out, Some(Duration::from_millis(5)));
    }
    drain(&rx, out, None);
    for p in pumps.into_iter().filter(|p| p.is_finished()) {
        let _ = p.join();
    }
    if let Some(msg) = failure {
        return Err(format!("{msg}; the other ranks of the group were stopped").into());
    }
    if let Some(sig) = interrupted {
        let codes: Vec<String> =
            ranks.iter().filter_map(|r| r.status.map(|s| format!("rank {}: {}", r.rank, describe(s)))).collect();
        return Err(
            format!("interrupted by {}, forwarded to every rank ({})", signal_name(sig), codes.join(", ")).into()
        );
    }
    Ok(())
}
