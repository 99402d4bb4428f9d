//! Test scaffolding: a process group whose ranks are threads of one process, behind the same
//! `Communicator` trait as NCCL, so that bucketing, overlap ordering, averaging, ZeRO sharding and
//! resuming on another world size are tested without GPUs. Real runs use NCCL only.
//!
//! Every collective is a round in which each rank deposits its data and takes everybody's; values
//! travel as f64 (exact for every dtype ferrograd has) and reductions run in rank order, so results
//! are deterministic. Ranks that call different collectives, or never call one, get an error naming
//! what each rank called or which ranks never arrived, instead of a hang.
//!
//! Point-to-point messages have two modes ([`P2p`]). `Buffered` (the default) queues a send and
//! returns at once. `Rendezvous` behaves as NCCL does, so that CI catches the orderings that hang
//! on GPUs: a send returns only once the peer has taken the message (`ncclSend` completes when the
//! matching `ncclRecv` runs); `send_recv` posts both halves before waiting for either (an NCCL
//! group); and the first message on each directed pair of ranks blocks the host until the peer has
//! reached its own first operation on that pair, as NCCL's lazy point-to-point connection set-up
//! does inside `ncclGroupEnd` (the cause of the first 2-GPU pipeline hang). Every operation then
//! also blocks its host until it completes, which is the strictest thing a GPU host can do (a
//! stream synchronisation, a lazily loaded kernel or a `cuMemFree` between any two operations):
//! a program that passes here cannot wait for ever on NCCL either, given that its connections are
//! made (see `pipeline::connect_peers`). A wait past the group's timeout is an error naming what
//! the rank waited for, and breaks the group so every other rank fails at once too.

use crate::comm::{check_buffer, check_peer, Communicator, ReduceOp, Work};
use crate::error::{DistError, DistResult};
use ferrograd_core::{DType, Device, Tensor};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

type Round = Arc<Result<Vec<Vec<f64>>, String>>;

/// How point-to-point messages behave (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum P2p {
    /// A send is queued and returns at once.
    Buffered,
    /// NCCL's semantics: a send waits for its receive, and the first use of each directed pair of
    /// ranks waits for the peer's first use of it (lazy connection set-up).
    Rendezvous,
}
/// Messages in flight per (sender, receiver): their signature and values.
type Mailboxes = HashMap<(usize, usize), VecDeque<(String, Vec<f64>)>>;

struct State {
    round: u64,
    slots: Vec<Option<(String, Vec<f64>)>>,
    arrived: usize,
    last: Round,
    mail: Mailboxes,
    /// Per directed pair (sender, receiver): messages taken by the receiver so far (rendezvous
    /// sends wait for theirs to be taken).
    taken: HashMap<(usize, usize), u64>,
    /// Per directed pair: messages posted so far.
    posted: HashMap<(usize, usize), u64>,
    /// Per directed pair: whether the sender / the receiver has reached its first operation on it.
    connecting: HashMap<(usize, usize), [bool; 2]>,
    /// A failed round poisons the group: every later call fails with this message.
    broken: Option<String>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    p2p: P2p,
    st: Mutex<State>,
    cv: Condvar,
}

pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadComm {
    /// `world` communicators, one per rank, to hand to `world` threads.
    pub fn group(world: usize) -> Vec<ThreadComm> {
        Self::group_with_timeout(world, Duration::from_secs(60))
    }

    pub fn group_with_timeout(world: usize, timeout: Duration) -> Vec<ThreadComm> {
        Self::group_with(world, timeout, P2p::Buffered)
    }

    /// `world` communicators whose point-to-point messages behave as NCCL's (`P2p::Rendezvous`).
    pub fn rendezvous_group(world: usize, timeout: Duration) -> Vec<ThreadComm> {
        Self::group_with(world, timeout, P2p::Rendezvous)
    }

    pub fn group_with(world: usize, timeout: Duration, p2p: P2p) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            world,
            timeout,
            p2p,
            st: Mutex::new(State {
                round: 0,
                slots: (0..world).map(|_| None).collect(),
                arrived: 0,
                last: Arc::new(Ok(vec![])),
                mail: HashMap::new(),
                taken: HashMap::new(),
                posted: HashMap::new(),
                connecting: HashMap::new(),
                broken: None,
            }),
            cv: Condvar::new(),
        });
        (0..world).map(|rank| ThreadComm { rank, shared: shared.clone() }).collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A wait that ran out: `msg` becomes the group's failure (every rank still waiting wakes and
    /// fails with it) and this rank's timeout error.
    fn give_up(&self, st: &mut State, msg: String, waited: Duration) -> DistError {
        st.broken = Some(msg.clone());
        self.shared.cv.notify_all();
        DistError::Timeout { op: msg, waited }
    }

    /// Deposit `data` under `sig` and return every rank's deposit, in rank order.
    fn exchange(&self, op: &'static str, sig: String, data: Vec<f64>) -> DistResult<Arc<Vec<Vec<f64>>>> {
        let world = self.shared.world;
        let mut st = self.lock();
        if let Some(b) = &st.broken {
            return Err(DistError::Collective { op, msg: b.clone() });
        }
        let my_round = st.round;
        st.slots[self.rank] = Some((sig, data));
        st.arrived += 1;
        if st.arrived == world {
            let all: Vec<(String, Vec<f64>)> = st.slots.iter_mut().map(|s| s.take().unwrap_or_default()).collect();
            let same = all.windows(2).all(|w| w[0].0 == w[1].0);
            st.last = Arc::new(if same {
                Ok(all.into_iter().map(|(_, d)| d).collect())
            } else {
                let calls: Vec<String> = all.iter().enumerate().map(|(r, (s, _))| format!("rank {r}: {s}")).collect();
                let msg = format!("ranks called different collectives ({})", calls.join(", "));
                st.broken = Some(msg.clone());
                Err(msg)
            });
            st.round += 1;
            st.arrived = 0;
            self.shared.cv.notify_all();
        } else {
            let start = Instant::now();
            while st.round == my_round && st.broken.is_none() {
                let left = self.shared.timeout.saturating_sub(start.elapsed());
                if left.is_zero() {
                    let missing: Vec<usize> = (0..world).filter(|&r| st.slots[r].is_none()).collect();
                    let msg = format!("{op} timed out: rank(s) {missing:?} never called it");
                    return Err(self.give_up(&mut st, msg, start.elapsed()));
                }
                st = self.shared.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
            }
            if let (Some(b), true) = (&st.broken, st.round == my_round) {
                return Err(DistError::Collective { op, msg: b.clone() });
            }
        }
        match &*st.last.clone() {
            Ok(v) => Ok(Arc::new(v.clone())),
            Err(m) => Err(DistError::Collective { op, msg: m.clone() }),
        }
    }
    /// Rendezvous mode: the first operation on each directed pair `(from, to)` waits until the
    /// other end (`side` 0 the sender, 1 the receiver) has reached its first operation on it.
    fn connect(&self, pairs: &[(usize, usize, usize)]) -> DistResult<()> {
        if self.shared.p2p == P2p::Buffered {
            return Ok(());
        }
        let mut st = self.lock();
        for &(from, to, side) in pairs {
            st.connecting.entry((from, to)).or_default()[side] = true;
        }
        self.shared.cv.notify_all();
        let start = Instant::now();
        loop {
            if let Some(b) = &st.broken {
                return Err(DistError::Collective { op: "connect", msg: b.clone() });
            }
            let missing = pairs.iter().find(|&&(f, t, _)| st.connecting.get(&(f, t)).is_none_or(|c| !(c[0] && c[1])));
            let Some(&(f, t, side)) = missing else { return Ok(()) };
            let left = self.shared.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let peer = if side == 0 { t } else { f };
                let msg = format!(
                    "rank {} waited {:?} for rank {peer} to make the connection {f}->{t} (NCCL connects a pair \
                     on its first message, blocking both hosts until each reaches it): a point-to-point hang",
                    self.rank,
                    start.elapsed()
                );
                return Err(self.give_up(&mut st, msg, start.elapsed()));
            }
            st = self.shared.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Queue `buf` for `peer`; returns how many messages on the pair precede it.
    fn post(&self, buf: &Tensor, peer: usize) -> DistResult<u64> {
        let data = buf.to_f64_vec()?;
        let mut st = self.lock();
        if let Some(b) = &st.broken {
            return Err(DistError::Collective { op: "send", msg: b.clone() });
        }
        st.mail.entry((self.rank, peer)).or_default().push_back((sig("message", buf), data));
        let n = st.posted.entry((self.rank, peer)).or_default();
        *n += 1;
        let n = *n - 1;
        self.shared.cv.notify_all();
        Ok(n)
    }

    /// Rendezvous mode: wait until `peer` has taken message `n` of this rank's messages to it.
    fn wait_taken(&self, peer: usize, n: u64) -> DistResult<()> {
        if self.shared.p2p == P2p::Buffered {
            return Ok(());
        }
        let start = Instant::now();
        let mut st = self.lock();
        loop {
            if st.taken.get(&(self.rank, peer)).is_some_and(|&t| t > n) {
                return Ok(());
            }
            if let Some(b) = &st.broken {
                return Err(DistError::Collective { op: "send", msg: b.clone() });
            }
            let left = self.shared.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let msg = format!(
                    "rank {} waited {:?} for rank {peer} to receive its message {n} (a send completes only when \
                     the matching receive runs): a point-to-point hang",
                    self.rank,
                    start.elapsed()
                );
                return Err(self.give_up(&mut st, msg, start.elapsed()));
            }
            st = self.shared.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Wait for the next message from `peer` and write it into `buf`.
    fn take(&self, buf: &Tensor, peer: usize) -> DistResult<()> {
        let start = Instant::now();
        let mut st = self.lock();
        loop {
            if let Some(b) = &st.broken {
                return Err(DistError::Collective { op: "recv", msg: b.clone() });
            }
            if let Some((s, data)) = st.mail.get_mut(&(peer, self.rank)).and_then(|q| q.pop_front()) {
                *st.taken.entry((peer, self.rank)).or_default() += 1;
                self.shared.cv.notify_all();
                drop(st);
                if s != sig("message", buf) {
                    return Err(DistError::Collective {
                        op: "recv",
                        msg: format!("rank {peer} sent a {s}, rank {} expected a {}", self.rank, sig("message", buf)),
                    });
                }
                return write(buf, 0, data);
            }
            let left = self.shared.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let msg = format!("recv from rank {peer} on rank {}: nothing arrived", self.rank);
                if self.shared.p2p == P2p::Rendezvous {
                    // The group's failure and this rank's error say the same.
                    return Err(self.give_up(&mut st, format!("{msg} (a point-to-point hang)"), start.elapsed()));
                }
                return Err(DistError::Timeout { op: msg, waited: start.elapsed() });
            }
            st = self.shared.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

fn sig(op: &str, t: &Tensor) -> String {
    format!("{op}({}, {} elements)", t.dtype(), t.elem_count())
}

fn reduce(parts: &[Vec<f64>], op: ReduceOp, range: std::ops::Range<usize>) -> Vec<f64> {
    range
        .map(|i| {
            let it = parts.iter().map(|p| p[i]);
            match op {
                ReduceOp::Sum => it.sum(),
                ReduceOp::Avg => it.sum::<f64>() / parts.len() as f64,
                ReduceOp::Min => it.fold(f64::INFINITY, f64::min),
                ReduceOp::Max => it.fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect()
}

/// Write `vals` into the elements `[start, start + vals.len())` of contiguous `buf`.
fn write(buf: &Tensor, start: usize, vals: Vec<f64>) -> DistResult<()> {
    let n = vals.len();
    let flat = buf.flatten_all()?.narrow(0, start, n)?;
    let src = Tensor::from_vec(vals, n, buf.device())?;
    let src = if buf.dtype() == DType::F64 { src } else { src.to_dtype(buf.dtype())? };
    Ok(flat.set(&src)?)
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn backend(&self) -> &'static str {
        "threads"
    }

    fn all_reduce(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work> {
        check_buffer("all_reduce", self, buf, false)?;
        let all = self.exchange("all_reduce", sig(&format!("all_reduce {op:?}"), buf), buf.to_f64_vec()?)?;
        write(buf, 0, reduce(&all, op, 0..buf.elem_count()))?;
        Ok(Work::done())
    }

    fn reduce_scatter(&self, buf: &Tensor, op: ReduceOp) -> DistResult<Work> {
        check_buffer("reduce_scatter", self, buf, true)?;
        let all = self.exchange("reduce_scatter", sig(&format!("reduce_scatter {op:?}"), buf), buf.to_f64_vec()?)?;
        let c = buf.elem_count() / self.shared.world;
        write(buf, self.rank * c, reduce(&all, op, self.rank * c..(self.rank + 1) * c))?;
        Ok(Work::done())
    }

    fn all_gather(&self, buf: &Tensor) -> DistResult<Work> {
        check_buffer("all_gather", self, buf, true)?;
        let c = buf.elem_count() / self.shared.world;
        let mine = buf.flatten_all()?.narrow(0, self.rank * c, c)?.to_f64_vec()?;
        let all = self.exchange("all_gather", sig("all_gather", buf), mine)?;
        write(buf, 0, all.concat())?;
        Ok(Work::done())
    }

    fn broadcast(&self, buf: &Tensor, root: usize) -> DistResult<Work> {
        check_buffer("broadcast", self, buf, false)?;
        if root >= self.shared.world {
            return Err(DistError::Collective {
                op: "broadcast",
                msg: format!("root {root} in a world of {}", self.shared.world),
            });
        }
        let data = if self.rank == root { buf.to_f64_vec()? } else { vec![] };
        let all = self.exchange("broadcast", sig(&format!("broadcast from {root}"), buf), data)?;
        if self.rank != root {
            write(buf, 0, all[root].clone())?;
        }
        Ok(Work::done())
    }

    fn send(&self, buf: &Tensor, peer: usize) -> DistResult<Work> {
        check_buffer("send", self, buf, false)?;
        check_peer("send", self, peer)?;
        self.connect(&[(self.rank, peer, 0)])?;
        let n = self.post(buf, peer)?;
        self.wait_taken(peer, n)?;
        Ok(Work::done())
    }

    fn recv(&self, buf: &Tensor, peer: usize) -> DistResult<Work> {
        check_buffer("recv", self, buf, false)?;
        check_peer("recv", self, peer)?;
        self.connect(&[(peer, self.rank, 1)])?;
        self.take(buf, peer)?;
        Ok(Work::done())
    }

    /// Both halves posted before waiting for either, as an NCCL group is.
    fn send_recv(&self, send: &Tensor, to: usize, recv: &Tensor, from: usize) -> DistResult<Work> {
        for (b, peer, op) in [(send, to, "send"), (recv, from, "recv")] {
            check_buffer(op, self, b, false)?;
            check_peer(op, self, peer)?;
        }
        self.connect(&[(self.rank, to, 0), (from, self.rank, 1)])?;
        let n = self.post(send, to)?;
        self.take(recv, from)?;
        self.wait_taken(to, n)?;
        Ok(Work::done())
    }

    fn barrier(&self) -> DistResult<()> {
        self.exchange("barrier", "barrier".into(), vec![]).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.lock();
        if st.broken.is_none() {
            st.broken = Some(format!("rank {} failed: {reason}", self.rank));
        }
        self.shared.cv.notify_all();
    }
}

/// Run `f` on `world` threads, one rank each, and return their results in rank order.
pub fn run_ranks<R: Send>(world: usize, f: impl Fn(Arc<dyn Communicator>) -> R + Sync) -> Vec<R> {
    run_group(ThreadComm::group(world), f)
}

/// `run_ranks` over the given communicators (e.g. `ThreadComm::rendezvous_group`).
pub fn run_group<R: Send>(comms: Vec<ThreadComm>, f: impl Fn(Arc<dyn Communicator>) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(Arc::new(c)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}
