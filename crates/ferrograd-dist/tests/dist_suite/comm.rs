//! The communicator contract on the thread backend (every collective's values, mismatched calls,
//! a rank that never comes), and the TCP rendezvous over loopback: the id reaches every rank, and a
//! timeout names the ranks that never arrived.

use ferrograd_core::{DType, Device, Tensor};
use ferrograd_dist::comm::{Communicator, ReduceOp};
use ferrograd_dist::rendezvous::{exchange_id, RendezvousConfig, ID_BYTES};
use ferrograd_dist::testing::{run_ranks, ThreadComm};
use ferrograd_dist::DistError;
use std::time::{Duration, Instant};

fn t(v: Vec<f32>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, n, Device::Cpu).unwrap()
}

#[test]
fn collectives_compute_what_they_promise() {
    let out = run_ranks(3, |c| {
        let r = c.rank() as f32;
        let x = |k: f32| t(vec![r + k, 10.0 * r, -r, 1.0, 2.0, 3.0]);
        let sum = x(0.0);
        c.all_reduce(&sum, ReduceOp::Sum).unwrap().wait().unwrap();
        let avg = x(0.0);
        c.all_reduce(&avg, ReduceOp::Avg).unwrap().wait().unwrap();
        let (mn, mx) = (x(0.0), x(0.0));
        c.all_reduce(&mn, ReduceOp::Min).unwrap().wait().unwrap();
        c.all_reduce(&mx, ReduceOp::Max).unwrap().wait().unwrap();
        let rs = x(0.0);
        c.reduce_scatter(&rs, ReduceOp::Sum).unwrap().wait().unwrap();
        let ag = t(vec![-1.0; 6]);
        ag.narrow(0, 2 * c.rank(), 2).unwrap().set(&t(vec![r, r + 0.5])).unwrap();
        c.all_gather(&ag).unwrap().wait().unwrap();
        let bc = x(7.0);
        c.broadcast(&bc, 2).unwrap().wait().unwrap();
        // A ring: each rank sends to the next and receives from the previous.
        let (next, prev) = ((c.rank() + 1) % 3, (c.rank() + 2) % 3);
        let got = t(vec![0.0; 2]);
        c.send_recv(&t(vec![r, r * r]), next, &got, prev).unwrap().wait().unwrap();
        c.barrier().unwrap();
        [sum, avg, mn, mx, rs, ag, bc, got].map(|v| v.to_vec::<f32>().unwrap())
    });
    for (rank, [sum, avg, mn, mx, rs, ag, bc, got]) in out.into_iter().enumerate() {
        assert_eq!(sum, vec![3.0, 30.0, -3.0, 3.0, 6.0, 9.0]);
        assert_eq!(avg, vec![1.0, 10.0, -1.0, 1.0, 2.0, 3.0]);
        assert_eq!(mn, vec![0.0, 0.0, -2.0, 1.0, 2.0, 3.0]);
        assert_eq!(mx, vec![2.0, 20.0, 0.0, 1.0, 2.0, 3.0]);
        // Chunk `rank` holds the sum of every rank's chunk `rank`; the rest is this rank's input.
        let r = rank as f32;
        let mut want = vec![r, 10.0 * r, -r, 1.0, 2.0, 3.0];
        want[2 * rank] = [3.0, -3.0, 6.0][rank];
        want[2 * rank + 1] = [30.0, 3.0, 9.0][rank];
        assert_eq!(rs, want, "rank {rank}");
        assert_eq!(ag, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        assert_eq!(bc, vec![9.0, 20.0, -2.0, 1.0, 2.0, 3.0]);
        let p = ((rank + 2) % 3) as f32;
        assert_eq!(got, vec![p, p * p]);
    }
}

#[test]
fn mismatched_or_bad_calls_are_errors_not_hangs() {
    let errs = run_ranks(2, |c| {
        let x = t(vec![1.0; 4]);
        if c.rank() == 0 {
            c.all_reduce(&x, ReduceOp::Sum).err().map(|e| e.to_string())
        } else {
            c.broadcast(&x, 0).err().map(|e| e.to_string())
        }
    });
    for e in errs {
        let e = e.expect("mismatched collectives must fail");
        assert!(e.contains("rank 0: all_reduce") && e.contains("rank 1: broadcast"), "{e}");
    }
    let c = &ThreadComm::group(2)[0];
    let odd = t(vec![1.0; 3]);
    assert!(matches!(c.reduce_scatter(&odd, ReduceOp::Sum), Err(DistError::Collective { .. })));
    assert!(c.send(&odd, 0).is_err(), "a rank cannot send to itself");
    let strided = Tensor::zeros((2, 3), DType::F32, Device::Cpu).unwrap().t().unwrap();
    assert!(c.all_reduce(&strided, ReduceOp::Sum).is_err());
}

#[test]
fn a_rank_that_never_calls_is_named() {
    let comms = ThreadComm::group_with_timeout(3, Duration::from_millis(300));
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .filter(|c| c.rank() != 2)
            .map(|c| s.spawn(move || c.all_reduce(&t(vec![1.0]), ReduceOp::Sum).unwrap_err().to_string()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(errs.iter().any(|e| e.contains("[2] never called")), "{errs:?}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn cfg(rank: usize, world: usize, port: u16, ms: u64) -> RendezvousConfig {
    RendezvousConfig { rank, world_size: world, addr: format!("127.0.0.1:{port}"), timeout: Duration::from_millis(ms) }
}

#[test]
fn rendezvous_hands_rank_0s_id_to_every_rank() {
    let port = free_port();
    let mut id = [0u8; ID_BYTES];
    id.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 7 + 3) as u8);
    let got: Vec<[u8; ID_BYTES]> = std::thread::scope(|s| {
        // The other ranks start first: they retry until rank 0 listens.
        let hs: Vec<_> =
            [3, 1, 2].map(|r| s.spawn(move || exchange_id(&cfg(r, 4, port, 10_000), None).unwrap())).into();
        std::thread::sleep(Duration::from_millis(200));
        let mine = exchange_id(&cfg(0, 4, port, 10_000), Some(id)).unwrap();
        let mut v: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        v.push(mine);
        v
    });
    assert!(got.iter().all(|g| *g == id));
}

#[test]
fn rendezvous_timeout_names_the_ranks_that_never_arrived() {
    let port = free_port();
    let start = Instant::now();
    let (r0, r2) = std::thread::scope(|s| {
        let h2 = s.spawn(move || exchange_id(&cfg(2, 4, port, 800), None));
        let r0 = exchange_id(&cfg(0, 4, port, 800), Some([1; ID_BYTES]));
        (r0, h2.join().unwrap())
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    match r0 {
        Err(DistError::RendezvousTimeout { missing, arrived, world, .. }) => {
            assert_eq!((missing, arrived, world), (vec![1, 3], vec![0, 2], 4));
        }
        other => panic!("rank 0: {other:?}"),
    }
    let e = r2.unwrap_err().to_string();
    assert!(e.contains("rank 0 reports") && e.contains("[1, 3] of 4 never arrived"), "{e}");
    let msg = DistError::RendezvousTimeout {
        addr: "h:1".into(),
        world: 4,
        missing: vec![1, 3],
        arrived: vec![0, 2],
        waited: Duration::from_secs(300),
    }
    .to_string();
    assert!(msg.contains("FERROGRAD_DIST_TIMEOUT"), "{msg}");
}

#[test]
fn rendezvous_refuses_a_wrong_world_size_and_reports_an_absent_rank_0() {
    let port = free_port();
    let (r0, r1) = std::thread::scope(|s| {
        let h1 = s.spawn(move || exchange_id(&cfg(1, 3, port, 5_000), None));
        let r0 = exchange_id(&cfg(0, 2, port, 5_000), Some([0; ID_BYTES]));
        (r0, h1.join().unwrap())
    });
    assert!(r0.unwrap_err().to_string().contains("world size is 3, rank 0 says 2"));
    assert!(r1.unwrap_err().to_string().contains("world size is 3"));
    let lonely = exchange_id(&cfg(1, 2, free_port(), 300), None).unwrap_err();
    assert!(matches!(lonely, DistError::RendezvousUnreachable { .. }), "{lonely}");
}
