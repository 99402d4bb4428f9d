//! `ferrograd launch` with ordinary child processes (no GPU): the variables each rank gets, rank
//! prefixes on both streams, a rank that fails or is killed stopping the group with a clear
//! message (no hang), and signals forwarded to every rank.

use crate::common;

use common::{bin, text};
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let o = Command::new(bin()).arg("launch").args(args).output().expect("failed to start ferrograd");
    (o, t.elapsed())
}

#[test]
fn every_rank_gets_its_variables_and_a_prefix_on_both_streams() {
    let script = r#"echo "r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE n=$GROUP_RANK m=$MASTER_ADDR:$MASTER_PORT f=$FERROGRAD_LAUNCH"; echo "to-stderr $RANK" >&2; printf no-newline"#;
    let (o, _) = launch(&["--nproc-per-node", "3", "--", "sh", "-c", script]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    for r in 0..3 {
        assert!(out.contains(&format!("[rank {r}] r={r} w=3 l={r} lw=3 n=0 m=127.0.0.1:29500 f=1\n")), "{out}");
        assert!(out.contains(&format!("[rank {r}] no-newline\n")), "{out}");
        assert!(err.contains(&format!("[rank {r}] to-stderr {r}\n")), "{err}");
    }
    // Several nodes: this node's ranks and the shared master.
    let (o, _) = launch(&[
        "--nproc-per-node",
        "2",
        "--nnodes",
        "3",
        "--node-rank",
        "2",
        "--master-addr",
        "10.1.2.3",
        "--master-port",
        "1234",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("[rank 4] r=4 w=6 l=0 lw=2 n=2 m=10.1.2.3:1234"), "{out}");
    assert!(out.contains("[rank 5] r=5 w=6 l=1 lw=2 n=2 m=10.1.2.3:1234"), "{out}");
}

#[test]
fn a_failing_rank_stops_the_group_and_names_itself() {
    // Rank 1 fails while rank 0 would run for a minute (like a rank stuck in a collective).
    let script = r#"if [ "$RANK" = 1 ]; then sleep 0.3; echo bye; exit 3; fi; exec sleep 60"#;
    let (o, took) = launch(&["--nproc-per-node", "2", "--", "sh", "-c", script]);
    let (out, err) = text(&o);
    assert!(!o.status.success());
    assert!(took < Duration::from_secs(20), "the group was not stopped promptly ({took:?})");
    assert!(out.contains("[rank 1] bye"), "{out}");
    assert!(err.contains("rank 1 (local rank 1, pid") && err.contains("exited with status 3"), "{err}");
    assert!(err.contains("stopping rank(s) 0"), "{err}");
    assert!(err.contains("error: ") && err.contains("the other ranks of the group were stopped"), "{err}");

    let script = r#"if [ "$RANK" = 0 ]; then sleep 0.3; kill -9 $$; fi; exec sleep 60"#;
    let (o, took) = launch(&["--nproc-per-node", "3", "--", "sh", "-c", script]);
    let (_, err) = text(&o);
    assert!(!o.status.success() && took < Duration::from_secs(20), "{took:?}");
    assert!(err.contains("rank 0 (local rank 0") && err.contains("killed by signal 9 (SIGKILL)"), "{err}");
    assert!(err.contains("stopping rank(s) 1, 2"), "{err}");
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let script = r#"if [ "$RANK" = 1 ]; then exit 5; fi; trap "" TERM; while :; do sleep 0.05; done"#;
    let (o, took) = launch(&["--nproc-per-node", "2", "--stop-grace", "0.5", "--", "sh", "-c", script]);
    assert!(!o.status.success());
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(text(&o).1.contains("exited with status 5"));
}

#[test]
fn signals_reach_every_rank() {
    let script = r#"trap "echo got-TERM-$RANK; exit 0" TERM; echo ready-$RANK; while :; do sleep 0.05; done"#;
    let mut child = Command::new(bin())
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut ready = 0;
    while ready < 2 {
        let l = lines.next().expect("launcher ended early").unwrap();
        ready += l.contains("] ready-") as usize;
    }
    let t = Instant::now();
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let status = child.wait().unwrap();
    assert!(t.elapsed() < Duration::from_secs(20));
    for r in 0..2 {
        assert!(rest.contains(&format!("[rank {r}] got-TERM-{r}")), "{rest:?}");
    }
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("interrupted by signal 15 (SIGTERM), forwarded to every rank"), "{err}");
}

#[test]
fn ferrograd_runs_this_binary_and_bad_flags_are_errors() {
    let (o, _) = launch(&["--nproc-per-node", "2", "--", "ferrograd", "--version"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let v = env!("CARGO_PKG_VERSION");
    assert!(
        out.contains(&format!("[rank 0] ferrograd {v}")) && out.contains(&format!("[rank 1] ferrograd {v}")),
        "{out}"
    );

    for (args, want) in [
        (&["--nproc-per-node", "2", "--nnodes", "2", "--", "true"][..], "--master-addr is required"),
        (&["--nproc-per-node", "0", "--", "true"][..], "--nproc-per-node"),
        (
            &["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "--", "true"][..],
            "--node-rank 2",
        ),
        (&["--nproc-per-node", "1", "--", "/nonexistent/program"][..], "cannot start /nonexistent/program"),
    ] {
        let (o, _) = launch(args);
        let (_, err) = text(&o);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
}
