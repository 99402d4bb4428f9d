//! Pipeline schedules as plain data: for each of `p` stages (one per rank), the ordered list of
//! (stage, micro-batch, forward | backward) actions it runs in one training step, and from it the
//! rank's *program*: the computations with the point-to-point messages between them, grouped as
//! NCCL must receive them. Everything here is checked without a GPU:
//!
//! - `validate`: every stage runs each micro-batch's forward and backward exactly once, forward
//!   first;
//! - `simulate`: runs the stages on a virtual clock (a forward takes `tf`, a backward `tb`, messages
//!   are instant) and returns the makespan, each stage's busy time and its peak number of
//!   micro-batches whose activations are held (forward done, backward not yet): the bubble of both
//!   schedules is `(p - 1) / (m + p - 1)` of the step, GPipe holds `m` micro-batches on every stage,
//!   1F1B at most `p - s` on stage `s`;
//! - `check_programs`: executes every rank's program under *rendezvous* semantics (a group of
//!   sends and receives completes only when each peer has posted the matching operation in the
//!   group at the head of its stream, as NCCL's point-to-point calls behave) and reports a deadlock
//!   naming what each rank waits for.
//!
//! Why the messages are grouped: in 1F1B's steady state stage `s` sends micro-batch `i + w`'s
//! activation and then needs micro-batch `i`'s gradient, while stage `s + 1` sends that gradient
//! and then needs the activation. Posted one after the other both ranks would send first and wait
//! for ever; posted as one group (`Communicator::send_recv`, NCCL's group calls) both pairs match.

use crate::error::{DistError, DistResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    Backward,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    pub stage: usize,
    pub micro: usize,
    pub pass: Pass,
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = if self.pass == Pass::Forward { 'F' } else { 'B' };
        write!(f, "{p}{}@{}", self.micro, self.stage)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al., 2019): holds every micro-batch's
    /// activations until the backwards start.
    GPipe,
    /// One forward, one backward (PipeDream-Flush, Narayanan et al., 2021): stage `s` runs
    /// `p - 1 - s` warm-up forwards, then alternates; same bubble as GPipe, fewer held activations.
    OneFOneB,
}

impl std::str::FromStr for ScheduleKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" | "onefoneb" => Ok(ScheduleKind::OneFOneB),
            _ => Err(format!("schedule {s:?}: expected gpipe or 1f1b")),
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub stages: usize,
    pub micro_batches: usize,
    /// `per_stage[s]`: the actions stage `s` runs, in order.
    pub per_stage: Vec<Vec<Action>>,
}

/// The theoretical bubble fraction of GPipe and 1F1B with `p` equal stages and `m` micro-batches.
pub fn theoretical_bubble(p: usize, m: usize) -> f64 {
    if p == 0 || m == 0 {
        return 0.0;
    }
    (p - 1) as f64 / (m + p - 1) as f64
}

impl Schedule {
    pub fn new(kind: ScheduleKind, stages: usize, micro_batches: usize) -> DistResult<Schedule> {
        if stages == 0 || micro_batches == 0 {
            return Err(DistError::Collective {
                op: "pipeline schedule",
                msg: format!("needs at least one stage and one micro-batch (got {stages} and {micro_batches})"),
            });
        }
        let (p, m) = (stages, micro_batches);
        let act = |stage, micro, pass| Action { stage, micro, pass };
        let per_stage = (0..p)
            .map(|s| match kind {
                ScheduleKind::GPipe => {
                    (0..m).map(|i| act(s, i, Pass::Forward)).chain((0..m).map(|i| act(s, i, Pass::Backward))).collect()
                }
                ScheduleKind::OneFOneB => {
                    let warm = (p - 1 - s).min(m);
                    let mut v: Vec<Action> = (0..warm).map(|i| act(s, i, Pass::Forward)).collect();
                    for i in 0..m - warm {
                        v.push(act(s, warm + i, Pass::Forward));
                        v.push(act(s, i, Pass::Backward));
                    }
                    v.extend((m - warm..m).map(|i| act(s, i, Pass::Backward)));
                    v
                }
            })
            .collect();
        Ok(Schedule { kind, stages, micro_batches, per_stage })
    }

    /// Each stage runs every micro-batch's forward and backward exactly once, forward first.
    pub fn validate(&self) -> DistResult<()> {
        let bad = |msg: String| Err(DistError::Collective { op: "pipeline schedule", msg });
        if self.per_stage.len() != self.stages {
            return bad(format!("{} stage lists for {} stages", self.per_stage.len(), self.stages));
        }
        for (s, list) in self.per_stage.iter().enumerate() {
            let m = self.micro_batches;
            let (mut fwd, mut bwd) = (vec![false; m], vec![false; m]);
            for a in list {
                if a.stage != s || a.micro >= m {
                    return bad(format!("stage {s} lists {a}"));
                }
                if a.pass == Pass::Backward && !fwd[a.micro] {
                    return bad(format!("stage {s} runs {a} before its forward"));
                }
                let seen = if a.pass == Pass::Forward { &mut fwd } else { &mut bwd };
                if seen[a.micro] {
                    return bad(format!("stage {s} runs {a} twice"));
                }
                seen[a.micro] = true;
            }
            if let Some(i) = (0..m).find(|&i| !fwd[i] || !bwd[i]) {
                return bad(format!("stage {s} never runs micro-batch {i}'s forward and backward"));
            }
        }
        Ok(())
    }

    /// The action whose result `a` needs from another stage (none for the first forward and the
    /// last stage's backward, whose loss is its own).
    pub fn dependency(&self, a: Action) -> Option<Action> {
        match a.pass {
            Pass::Forward if a.stage > 0 => Some(Action { stage: a.stage - 1, ..a }),
            Pass::Backward if a.stage + 1 < self.stages => Some(Action { stage: a.stage + 1, ..a }),
            _ => None,
        }
    }

    /// Run the schedule on a virtual clock: forwards take `tf`, backwards `tb`, messages are
    /// instant, each stage runs its list in order as soon as the input is there.
    pub fn simulate(&self, tf: f64, tb: f64) -> DistResult<Simulation> {
        self.validate()?;
        let p = self.stages;
        let mut end: std::collections::HashMap<Action, f64> = Default::default();
        let mut next = vec![0usize; p];
        let mut free = vec![0.0f64; p];
        let mut busy = vec![0.0f64; p];
        let (mut held, mut peak) = (vec![0usize; p], vec![0usize; p]);
        loop {
            let mut progressed = false;
            for s in 0..p {
                while let Some(&a) = self.per_stage[s].get(next[s]) {
                    let ready = match self.dependency(a) {
                        None => 0.0,
                        Some(d) => match end.get(&d) {
                            Some(&t) => t,
                            None => break,
                        },
                    };
                    let dur = if a.pass == Pass::Forward { tf } else { tb };
                    let start = free[s].max(ready);
                    free[s] = start + dur;
                    busy[s] += dur;
                    end.insert(a, free[s]);
                    if a.pass == Pass::Forward {
                        held[s] += 1;
                        peak[s] = peak[s].max(held[s]);
                    } else {
                        held[s] -= 1;
                    }
                    next[s] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|s| next[s] == self.per_stage[s].len()) {
                break;
            }
            if !progressed {
                let waiting: Vec<String> = (0..p)
                    .filter_map(|s| self.per_stage[s].get(next[s]).map(|a| format!("stage {s} waits at {a}")))
                    .collect();
                return Err(DistError::Collective {
                    op: "pipeline schedule",
                    msg: format!("deadlock: {}", waiting.join(", ")),
                });
            }
        }
        let makespan = free.iter().cloned().fold(0.0, f64::max);
        Ok(Simulation { makespan, busy, peak_held: peak })
    }

    /// The program rank `s` runs: its computations in order, each receive posted (grouped with
    /// the previous computation's sends) before the computation that needs it.
    pub fn program(&self, s: usize) -> Vec<Op> {
        let mut ops = vec![];
        let mut pending_sends: Vec<Msg> = vec![];
        for &a in &self.per_stage[s] {
            let mut group = std::mem::take(&mut pending_sends);
            if let Some(d) = self.dependency(a) {
                group.push(Msg { dir: Dir::Recv, peer: d.stage, kind: a.pass, micro: a.micro });
            }
            if !group.is_empty() {
                ops.push(Op::Comm(group));
            }
            ops.push(Op::Compute(a));
            // The result the neighbour needs: the activation forward, its gradient backward.
            let to = match a.pass {
                Pass::Forward if s + 1 < self.stages => Some(s + 1),
                Pass::Backward if s > 0 => Some(s - 1),
                _ => None,
            };
            if let Some(peer) = to {
                pending_sends.push(Msg { dir: Dir::Send, peer, kind: a.pass, micro: a.micro });
            }
        }
        if !pending_sends.is_empty() {
            ops.push(Op::Comm(pending_sends));
        }
        ops
    }

    /// Execute every rank's program under rendezvous semantics (see the module comment); `Ok`
    /// means no rank can wait for ever.
    pub fn check_programs(&self) -> DistResult<()> {
        check_rendezvous(&(0..self.stages).map(|s| self.program(s)).collect::<Vec<_>>())
    }
}

/// Execute the ranks' programs under rendezvous semantics; `Ok` means no rank can wait for ever.
/// A rank's stream reaches its next group only when every operation of the current one has
/// completed; an operation of the current group completes once the peer's current group holds the
/// matching one (the operations of one group progress independently, as NCCL's do).
pub fn check_rendezvous(progs: &[Vec<Op>]) -> DistResult<()> {
    let ranks = progs.len();
    let mut pc = vec![0usize; ranks];
    // Completed operations of each rank's current group.
    let mut done: Vec<Vec<Msg>> = vec![vec![]; ranks];
    loop {
        // Computations never wait on other ranks by themselves.
        for r in 0..ranks {
            while matches!(progs[r].get(pc[r]), Some(Op::Compute(_))) {
                pc[r] += 1;
            }
        }
        let head = |r: usize| match progs[r].get(pc[r]) {
            Some(Op::Comm(g)) => Some(g),
            _ => None,
        };
        if (0..ranks).all(|r| head(r).is_none()) {
            return Ok(());
        }
        let mut progressed = false;
        for r in 0..ranks {
            let Some(g) = head(r) else { continue };
            for m in g {
                if done[r].contains(m) || m.peer >= ranks {
                    continue;
                }
                let want = Msg { dir: m.dir.flip(), peer: r, ..*m };
                if head(m.peer).is_some_and(|pg| pg.contains(&want)) && !done[m.peer].contains(&want) {
                    done[r].push(*m);
                    done[m.peer].push(want);
                    progressed = true;
                }
            }
        }
        let finished: Vec<usize> =
            (0..ranks).filter(|&r| head(r).is_some_and(|g| g.iter().all(|m| done[r].contains(m)))).collect();
        if !progressed && finished.is_empty() {
            let waits: Vec<String> =
                (0..ranks).filter_map(|r| head(r).map(|g| format!("rank {r} at {}", describe(g)))).collect();
            return Err(DistError::Collective {
                op: "pipeline schedule",
                msg: format!("point-to-point deadlock: {}", waits.join("; ")),
            });
        }
        for r in finished {
            pc[r] += 1;
            done[r].clear();
        }
    }
}

fn describe(g: &[Msg]) -> String {
    let parts: Vec<String> = g.iter().map(|m| m.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// What `simulate` found.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    pub makespan: f64,
    /// Time each stage computed.
    pub busy: Vec<f64>,
    /// Most micro-batches whose activations a stage held at once.
    pub peak_held: Vec<usize>,
}

impl Simulation {
    /// Idle share of all stages' time: `1 - sum(busy) / (p * makespan)`.
    pub fn bubble(&self) -> f64 {
        let p = self.busy.len() as f64;
        1.0 - self.busy.iter().sum::<f64>() / (p * self.makespan)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Send,
    Recv,
}

impl Dir {
    fn flip(self) -> Dir {
        match self {
            Dir::Send => Dir::Recv,
            Dir::Recv => Dir::Send,
        }
    }
}

/// One point-to-point message: an activation (`Forward`) or its gradient (`Backward`) of one
/// micro-batch, to or from `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Msg {
    pub dir: Dir,
    pub peer: usize,
    pub kind: Pass,
    pub micro: usize,
}

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.kind == Pass::Forward { "activation" } else { "gradient" };
        let dir = if self.dir == Dir::Send { "send to" } else { "recv from" };
        write!(f, "{dir} {} {what} {}", self.peer, self.micro)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Sends and receives posted together (one NCCL group).
    Comm(Vec<Msg>),
    Compute(Action),
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [ScheduleKind; 2] = [ScheduleKind::GPipe, ScheduleKind::OneFOneB];

    #[test]
    fn orders_are_the_published_ones() -> DistResult<()> {
        let s = Schedule::new(ScheduleKind::OneFOneB, 4, 6)?;
        let names = |l: &[Action]| l.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(" ");
        assert_eq!(names(&s.per_stage[0]), "F0@0 F1@0 F2@0 F3@0 B0@0 F4@0 B1@0 F5@0 B2@0 B3@0 B4@0 B5@0");
        assert_eq!(names(&s.per_stage[3]), "F0@3 B0@3 F1@3 B1@3 F2@3 B2@3 F3@3 B3@3 F4@3 B4@3 F5@3 B5@3");
        let g = Schedule::new(ScheduleKind::GPipe, 2, 3)?;
        assert_eq!(names(&g.per_stage[1]), "F0@1 F1@1 F2@1 B0@1 B1@1 B2@1");
        Ok(())
    }

    #[test]
    fn every_schedule_is_valid_and_its_bubble_is_the_theory() -> DistResult<()> {
        for kind in KINDS {
            for p in 1..=8 {
                for m in 1..=16 {
                    let s = Schedule::new(kind, p, m)?;
                    s.validate()?;
                    // Equal stage times, backward twice the forward (the usual ratio) or equal.
                    for (tf, tb) in [(1.0, 1.0), (1.0, 2.0)] {
                        let sim = s.simulate(tf, tb)?;
                        let theory = theoretical_bubble(p, m);
                        assert!(
                            (sim.bubble() - theory).abs() < 1e-12,
                            "{kind} p={p} m={m} tf={tf} tb={tb}: bubble {} vs {theory}",
                            sim.bubble()
                        );
                        assert_eq!(sim.makespan, (m + p - 1) as f64 * (tf + tb), "{kind} p={p} m={m}");
                        for (st, &held) in sim.peak_held.iter().enumerate() {
                            let want = if kind == ScheduleKind::GPipe { m } else { (p - st).min(m) };
                            assert_eq!(held, want, "{kind} p={p} m={m} stage {st}");
                        }
                    }
                    s.check_programs()
                        .map_err(|e| DistError::Collective { op: "test", msg: format!("{kind} p={p} m={m}: {e}") })?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn one_f_one_b_holds_no_more_than_gpipe() -> DistResult<()> {
        for p in 1..=6 {
            for m in 1..=12 {
                let a = Schedule::new(ScheduleKind::OneFOneB, p, m)?.simulate(1.0, 2.0)?;
                let b = Schedule::new(ScheduleKind::GPipe, p, m)?.simulate(1.0, 2.0)?;
                assert!(a.peak_held.iter().zip(&b.peak_held).all(|(x, y)| x <= y));
            }
        }
        Ok(())
    }

    #[test]
    fn programs_send_what_the_neighbour_receives() -> DistResult<()> {
        let s = Schedule::new(ScheduleKind::OneFOneB, 3, 5)?;
        for r in 0..3 {
            let prog = s.program(r);
            let computes: Vec<Action> =
                prog.iter().filter_map(|o| if let Op::Compute(a) = o { Some(*a) } else { None }).collect();
            assert_eq!(computes, s.per_stage[r]);
            let count = |dir, peer| {
                prog.iter()
                    .filter_map(|o| if let Op::Comm(g) = o { Some(g) } else { None })
                    .flatten()
                    .filter(|m| m.dir == dir && m.peer == peer)
                    .count()
            };
            if r > 0 {
                // An activation in and a gradient out per micro-batch.
                assert_eq!((count(Dir::Recv, r - 1), count(Dir::Send, r - 1)), (5, 5));
            }
            if r < 2 {
                assert_eq!((count(Dir::Send, r + 1), count(Dir::Recv, r + 1)), (5, 5));
            }
        }
        Ok(())
    }

    #[test]
    fn ungrouped_sends_and_broken_lists_are_caught() -> DistResult<()> {
        // 1F1B with every message posted on its own: the steady state's send-send deadlock.
        let s = Schedule::new(ScheduleKind::OneFOneB, 2, 4)?;
        let split: Vec<Vec<Op>> = (0..2)
            .map(|r| {
                s.program(r)
                    .into_iter()
                    .flat_map(|o| match o {
                        Op::Comm(g) => {
                            // Sends first, as a naive runner would post them.
                            let mut g = g;
                            g.sort_by_key(|m| m.dir != Dir::Send);
                            g.into_iter().map(|m| Op::Comm(vec![m])).collect::<Vec<_>>()
                        }
                        c => vec![c],
                    })
                    .collect()
            })
            .collect();
        let e = check_rendezvous(&split).unwrap_err().to_string();
        assert!(e.contains("point-to-point deadlock"), "{e}");
        s.check_programs()?;
        // A broken list: a backward before its forward, a missing micro-batch.
        let mut s = Schedule::new(ScheduleKind::GPipe, 2, 2)?;
        s.per_stage[1].swap(0, 2);
        assert!(s.validate().unwrap_err().to_string().contains("before its forward"));
        let mut s = Schedule::new(ScheduleKind::GPipe, 2, 2)?;
        s.per_stage[0].pop();
        assert!(s.validate().unwrap_err().to_string().contains("never runs"));
        // Stage 0 running its backwards before stage 1 can have them: a deadlock the clock finds.
        let mut s = Schedule::new(ScheduleKind::GPipe, 2, 2)?;
        s.per_stage[1] = vec![
            Action { stage: 1, micro: 1, pass: Pass::Forward },
            Action { stage: 1, micro: 0, pass: Pass::Forward },
            Action { stage: 1, micro: 0, pass: Pass::Backward },
            Action { stage: 1, micro: 1, pass: Pass::Backward },
        ];
        s.validate()?;
        // Messages arrive in order on a link, so the checker sees rank 1 wanting activation 1
        // while rank 0 offers activation 0.
        assert!(s.check_programs().unwrap_err().to_string().contains("deadlock"), "out-of-order receive");
        assert!(Schedule::new(ScheduleKind::GPipe, 0, 3).is_err());
        Ok(())
    }
}
