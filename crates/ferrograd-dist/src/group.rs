//! `ProcessGroup::init()`: who this process is (launcher variables), which GPU it drives
//! (`cuda:LOCAL_RANK`), and an NCCL communicator with every other rank, reached through the TCP
//! rendezvous. Without launcher variables, or with a world of one, it is a single process and needs
//! no NCCL.

use crate::comm::{Communicator, Solo};
use crate::env::DistEnv;
use crate::error::{DistError, DistResult};
use crate::nccl::NcclComm;
use crate::rendezvous::{exchange_id, RendezvousConfig};
use ferrograd_core::cuda::CudaDevice;
use ferrograd_core::Device;
use std::sync::Arc;

pub struct ProcessGroup {
    env: Option<DistEnv>,
    comm: Arc<dyn Communicator>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ProcessGroup(rank {} of {}, {}, {})",
            self.rank(),
            self.world_size(),
            self.device(),
            self.comm.backend()
        )
    }
}

impl ProcessGroup {
    /// From the environment: a world of one without launcher variables (on `Device::best()`), else
    /// rank `RANK` of `WORLD_SIZE` on `cuda:LOCAL_RANK` over NCCL.
    pub fn init() -> DistResult<ProcessGroup> {
        match DistEnv::from_env()? {
            None => Ok(Self::single(Device::best()?)),
            Some(env) => Self::from_env(env),
        }
    }

    /// A world of one on `device`.
    pub fn single(device: Device) -> ProcessGroup {
        ProcessGroup { env: None, comm: Arc::new(Solo::new(device)) }
    }

    /// A group over any communicator (tests use `testing::ThreadComm`).
    pub fn with_comm(comm: Arc<dyn Communicator>) -> ProcessGroup {
        ProcessGroup { env: None, comm }
    }

    pub fn from_env(env: DistEnv) -> DistResult<ProcessGroup> {
        let visible = ferrograd_core::cuda::device_count().unwrap_or(0);
        if env.local_rank >= visible {
            let cvd = std::env::var("CUDA_VISIBLE_DEVICES")
                .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
                .unwrap_or_default();
            let msg = if visible == 0 {
                format!("this rank needs a GPU but none is visible{cvd}: multi-process runs use one GPU per process")
            } else {
                format!("this rank's GPU would be cuda:{} but only {visible} GPU(s) are visible{cvd}", env.local_rank)
            };
            if env.world_size > 1 || visible > 0 {
                return Err(DistError::Env { var: "LOCAL_RANK", value: env.local_rank.to_string(), msg });
            }
        }
        if env.world_size == 1 {
            let device = if visible > 0 { Device::Cuda(env.local_rank) } else { Device::Cpu };
            return Ok(ProcessGroup { env: Some(env), comm: Arc::new(Solo::new(device)) });
        }
        let dev = CudaDevice::get(env.local_rank)?;
        // Every rank loads NCCL before the rendezvous, so a missing library fails at once.
        crate::nccl::nccl()?;
        let id = if env.rank == 0 { Some(NcclComm::unique_id()?) } else { None };
        let cfg = RendezvousConfig {
            rank: env.rank,
            world_size: env.world_size,
            addr: env.rendezvous_addr(),
            timeout: env.timeout,
        };
        let id = exchange_id(&cfg, id)?;
        let comm = NcclComm::init(dev, env.rank, env.world_size, id, env.timeout)?;
        Ok(ProcessGroup { env: Some(env), comm: Arc::new(comm) })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn local_rank(&self) -> usize {
        self.env.as_ref().map_or(0, |e| e.local_rank)
    }

    /// The device this rank trains on.
    pub fn device(&self) -> Device {
        self.comm.device()
    }

    pub fn comm(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }

    /// The launcher variables this group came from (`None` for a plain single process).
    pub fn env(&self) -> Option<&DistEnv> {
        self.env.as_ref()
    }

    pub fn is_distributed(&self) -> bool {
        self.world_size() > 1
    }

    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }
}
