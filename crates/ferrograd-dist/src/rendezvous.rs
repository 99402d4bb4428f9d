//! Handing rank 0's NCCL unique id to every other rank over TCP.
//!
//! Rank 0 listens on `MASTER_ADDR:port` (all interfaces) and waits until every other rank has
//! connected and said who it is; then it sends each the 128-byte id and closes. Other ranks retry
//! the connection until rank 0 is up. Everything is bounded by the timeout: rank 0 reports the
//! ranks that never arrived (and tells those that did), a rank that cannot reach rank 0 says so.
//!
//! Wire format (little endian): client `FGRDZV01` + rank u32 + world u32; server status u8, then
//! the 128-byte id (status 0) or a u32 length and a UTF-8 message (status 1).

use crate::error::{DistError, DistResult};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

pub const ID_BYTES: usize = 128;
const MAGIC: &[u8; 8] = b"FGRDZV01";
/// How long a connected client may take to say who it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Clients wait this much longer than rank 0, so that rank 0's account of a timeout reaches them.
const CLIENT_GRACE: Duration = Duration::from_secs(3);

#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    pub rank: usize,
    pub world_size: usize,
    /// `host:port` of rank 0.
    pub addr: String,
    pub timeout: Duration,
}

/// Rank 0: serve `id` to every other rank. Others: fetch it from rank 0.
pub fn exchange_id(cfg: &RendezvousConfig, id: Option<[u8; ID_BYTES]>) -> DistResult<[u8; ID_BYTES]> {
    match (cfg.rank, id) {
        (0, Some(id)) => serve(cfg, id).map(|()| id),
        (0, None) => Err(DistError::Rendezvous { addr: cfg.addr.clone(), msg: "rank 0 has no id to serve".into() }),
        _ => join(cfg),
    }
}

fn port_of(addr: &str) -> DistResult<u16> {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| DistError::Rendezvous { addr: addr.to_string(), msg: "no port in the address".into() })
}

/// Rank 0's side.
pub fn serve(cfg: &RendezvousConfig, id: [u8; ID_BYTES]) -> DistResult<()> {
    let rdzv_err = |msg: String| DistError::Rendezvous { addr: cfg.addr.clone(), msg };
    if cfg.world_size <= 1 {
        return Ok(());
    }
    let port = port_of(&cfg.addr)?;
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
        rdzv_err(format!(
            "rank 0 cannot listen on port {port}: {e} (another job on this port? pick another MASTER_PORT / \
             --master-port)"
        ))
    })?;
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let mut arrived: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
    let count = |a: &[Option<TcpStream>]| a.iter().filter(|s| s.is_some()).count();
    let mut failure: Option<String> = None;
    while count(&arrived) < cfg.world_size - 1 && failure.is_none() {
        if Instant::now() >= deadline {
            break;
        }
        match listener.accept() {
            Ok((mut s, peer)) => match read_hello(&mut s) {
                // Not one of ours (a port scanner, a health check): ignore it.
                Err(_) => continue,
                Ok((rank, world)) => {
                    let problem = if world != cfg.world_size {
                        Some(format!(
                            "rank {rank} ({peer}) says the world size is {world}, rank 0 says {}",
                            cfg.world_size
                        ))
                    } else if rank == 0 || rank >= cfg.world_size {
                        Some(format!("a process at {peer} claims rank {rank} in a world of {}", cfg.world_size))
                    } else if arrived[rank].is_some() {
                        Some(format!("rank {rank} arrived twice (the second from {peer}): two processes share a RANK"))
                    } else {
                        None
                    };
                    match problem {
                        Some(p) => {
                            let _ = send_error(&mut s, &p);
                            failure = Some(p);
                        }
                        None => arrived[rank] = Some(s),
                    }
                }
            },
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => failure = Some(format!("accept failed: {e}")),
        }
    }
    let have: Vec<usize> = (1..cfg.world_size).filter(|&r| arrived[r].is_some()).collect();
    let missing: Vec<usize> = (1..cfg.world_size).filter(|&r| arrived[r].is_none()).collect();
    if failure.is_none() && missing.is_empty() {
        for s in arrived.iter_mut().flatten() {
            s.write_all(&[0u8])?;
            s.write_all(&id)?;
            s.flush()?;
        }
        return Ok(());
    }
    let err = match failure {
        Some(msg) => rdzv_err(msg),
        None => DistError::RendezvousTimeout {
            addr: cfg.addr.clone(),
            world: cfg.world_size,
            missing,
            arrived: std::iter::once(0).chain(have).collect(),
            waited: start.elapsed(),
        },
    };
    let msg = format!("rank 0 reports: {err}");
    for s in arrived.iter_mut().flatten() {
        let _ = send_error(s, &msg);
    }
    Err(err)
}

fn read_hello(s: &mut TcpStream) -> std::io::Result<(usize, usize)> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let mut buf = [0u8; 16];
    s.read_exact(&mut buf)?;
    if &buf[..8] != MAGIC {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "not a ferrograd rendezvous client"));
    }
    let rank = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
    let world = u32::from_le_bytes([buf[12], buf[13], buf[14], buf[15]]) as usize;
    Ok((rank, world))
}

fn send_error(s: &mut TcpStream, msg: &str) -> std::io::Result<()> {
    s.write_all(&[1u8])?;
    s.write_all(&(msg.len() as u32).to_le_bytes())?;
    s.write_all(msg.as_bytes())?;
    s.flush()
}

fn resolve(addr: &str) -> DistResult<Vec<SocketAddr>> {
    let v: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| DistError::Rendezvous { addr: addr.to_string(), msg: format!("cannot resolve MASTER_ADDR: {e}") })?
        .collect();
    if v.is_empty() {
        return Err(DistError::Rendezvous { addr: addr.to_string(), msg: "MASTER_ADDR resolves to no address".into() });
    }
    Ok(v)
}

/// Every other rank's side.
pub fn join(cfg: &RendezvousConfig) -> DistResult<[u8; ID_BYTES]> {
    let start = Instant::now();
    let deadline = start + cfg.timeout + CLIENT_GRACE;
    let unreachable =
        |last: String| DistError::RendezvousUnreachable { addr: cfg.addr.clone(), waited: start.elapsed(), last };
    let (rank, world) = (u32::try_from(cfg.rank), u32::try_from(cfg.world_size));
    let (Ok(rank), Ok(world)) = (rank, world) else {
        return Err(DistError::Rendezvous { addr: cfg.addr.clone(), msg: "rank or world size too large".into() });
    };
    let mut last = String::from("no attempt made");
    let mut stream = None;
    'connect: while Instant::now() < deadline {
        // Resolved on every attempt: rank 0's name may only start resolving once its node is up.
        let addrs = match resolve(&cfg.addr) {
            Ok(a) => a,
            Err(e) => {
                last = e.to_string();
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(2))) {
                Ok(s) => {
                    stream = Some(s);
                    break 'connect;
                }
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let Some(mut s) = stream else { return Err(unreachable(last)) };
    let mut hello = [0u8; 16];
    hello[..8].copy_from_slice(MAGIC);
    hello[8..12].copy_from_slice(&rank.to_le_bytes());
    hello[12..].copy_from_slice(&world.to_le_bytes());
    s.write_all(&hello).map_err(|e| unreachable(format!("sending who we are: {e}")))?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status).map_err(|e| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            unreachable("rank 0 accepted the connection but sent nothing before the timeout".into())
        } else {
            unreachable(format!("reading rank 0's answer: {e}"))
        }
    })?;
    if status[0] == 0 {
        let mut id = [0u8; ID_BYTES];
        s.read_exact(&mut id).map_err(|e| unreachable(format!("reading the id: {e}")))?;
        return Ok(id);
    }
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| unreachable(format!("reading rank 0's error: {e}")))?;
    let n = (u32::from_le_bytes(len) as usize).min(1 << 16);
    let mut msg = vec![0u8; n];
    s.read_exact(&mut msg).map_err(|e| unreachable(format!("reading rank 0's error: {e}")))?;
    Err(DistError::Rendezvous { addr: cfg.addr.clone(), msg: String::from_utf8_lossy(&msg).into_owned() })
}
