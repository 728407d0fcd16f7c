"""Start torch.distributed the same way under every launcher (docs/deepspeed.md).

- `torchrun`, `deepspeed`, `accelerate launch`: RANK/WORLD_SIZE/MASTER_* are already set.
- `mpirun`: Open MPI or MPICH variables; DeepSpeed's MPI discovery (needs mpi4py) fills the rest.
- `srun` without another launcher: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, MASTER_ADDR from the
  first host of the job (or the environment), MASTER_PORT from the job id.
- a plain `python` process: a one-rank job on a free loopback port.
Rank and world size are always read back from torch.distributed, never from Accelerate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from curvzo_ds.environment import check_accelerator, check_master_addr, wait_for_rank0
from curvzo_ds.errors import ConfigError, RanksDisagree
from curvzo_ds.shard.comm import Comm
from curvzo_ds.startup import environment_ninja_first, extensions_dir, stdout_to_log

log = logging.getLogger("curvzo_ds")
CONNECT_WAIT = 300.0  # seconds a rank other than 0 waits to reach rank 0 (at most ddp_timeout): environment.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_kind(env=os.environ) -> str:
    if "RANK" in env and "WORLD_SIZE" in env:
        return "env"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    # Only srun's tasks (they carry SLURM_STEP_ID): an sbatch script itself also has SLURM_PROCID=0 and
    # SLURM_NTASKS=N, and a `curvzo-ds train` started there directly is a one-rank job, not rank 0 of N.
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    return "single"


def _slurm_env(env) -> None:
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        try:
            first = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                                   check=True).stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            first = "127.0.0.1"
        env["MASTER_ADDR"] = first
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def local_rank_of(env=os.environ) -> int:
    return int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("SLURM_LOCALID", "0"))))


CREATED: list[bool] = [False]  # init_distributed made this process's default group (cli.destroy_process_group reads it)


def init_distributed(timeout_seconds: float = 1800):
    """Initialise the default process group if needed; returns (rank, world_size, local_rank).

    On a GPU machine each rank first takes its own device (`cuda:LOCAL_RANK`), so NCCL's collectives and
    the engine's reductions run there. `timeout_seconds` bounds every collective: a rank that hangs
    instead of dying fails the job after that long (the `ddp_timeout` key).
    """
    check_launcher_env(os.environ)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank_of() % torch.cuda.device_count())
    if not dist.is_initialized():
        kind = launcher_kind()
        env = os.environ
        if kind == "slurm":
            _slurm_env(env)
        elif kind == "single":
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(_free_port()))
        if kind != "mpi":  # MPI discovery sets MASTER_ADDR and the port from rank 0 itself
            wait_for_rank0(env, min(timeout_seconds, CONNECT_WAIT))
        built = os.path.join(extensions_dir(), "deepspeed_shm_comm", "deepspeed_shm_comm.so")
        import deepspeed  # outside stdout_to_log: its logger keeps the sys.stdout it finds on import

        if (not torch.cuda.is_available() and not os.path.exists(built) and local_rank_of() == 0
                and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu"):
            # DeepSpeed builds its CPU op here once per Python environment (startup.py), silently.
            print(f"curvzo-ds: building DeepSpeed's CPU communication op, once for this Python environment (1-2 "
                  f"minutes; cached in {os.path.dirname(os.path.dirname(built))})", file=sys.stderr, flush=True)

        with stdout_to_log(), environment_ninja_first():
            port = int(env.get("MASTER_PORT", "29500"))
            if kind == "mpi":  # MPI discovery ignores MASTER_PORT (always 29500): use rank 0's, as for MASTER_ADDR
                from mpi4py import MPI

                port = MPI.COMM_WORLD.bcast(port, root=0)
            deepspeed.init_distributed(auto_mpi_discovery=(kind == "mpi"), verbose=False, distributed_port=port,
                                       timeout=datetime.timedelta(seconds=timeout_seconds))
            if dist.get_world_size() > 1:  # every rank done connecting before any may exit (a config error): a
                dist.barrier()  # rank that left during a peer's gloo handshake failed it ("Connection closed by peer")
        _unlink_shm_buffer()
        CREATED[0] = True
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, local_rank_of()


# (rank, size) pairs of each launcher's variables; a rank must be below its size.
_LAUNCHER_PAIRS = (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                   ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def check_launcher_env(env) -> None:
    """The launcher's variables that init_distributed reads, checked before any of them is used: each that is set is
    a whole number (a size at least 1), a rank is below its size (RANK=5 with WORLD_SIZE=2 would wait for ranks that
    never come until ddp_timeout), and MASTER_PORT is a port. Raises a one-line ConfigError naming the variable.
    SLURM's are checked only in an srun step (launcher_kind): an sbatch script's own shell has them too."""
    slurm_step = "SLURM_STEP_ID" in env
    for rank_key, size_key in _LAUNCHER_PAIRS:
        if rank_key.startswith("SLURM") and not slurm_step:
            continue
        values = {}
        for key, least in ((rank_key, 0), (size_key, 1)):
            raw = env.get(key)
            if raw is None:
                continue
            if not raw.strip().isdecimal() or int(raw) < least:
                raise ConfigError(f"the launcher's environment: {key}={raw!r} is not a whole number >= {least}: a "
                                  "launcher (torchrun, deepspeed, mpirun, srun) sets it; unset it to run one process")
            values[key] = int(raw)
        if len(values) == 2 and values[rank_key] >= values[size_key]:
            raise ConfigError(f"the launcher's environment: {rank_key}={values[rank_key]} is not below "
                              f"{size_key}={values[size_key]} (the ranks are 0..{values[size_key] - 1}): the job would "
                              "wait for ranks that never come; check the launcher's settings")
    port = env.get("MASTER_PORT")
    if port is not None and not (port.strip().isdecimal() and 1 <= int(port) <= 65535):
        raise ConfigError(f"the launcher's environment: MASTER_PORT={port!r} is not a port (1-65535)")
    check_master_addr(env)
    check_accelerator()


def _unlink_shm_buffer() -> None:
    """Remove the name of this rank's DeepSpeed CPU shared-memory all-reduce buffer.

    When every rank is on one machine (LOCAL_SIZE = world size: the deepspeed launcher, mpirun),
    DeepSpeed's CPU backend creates one buffer per rank in /dev/shm (69 MB, RAM-backed), named by
    uid, MASTER_ADDR, MASTER_PORT and rank, and never unlinks it (deepspeed 0.19.8): every run would
    leave its buffers behind. Each rank maps every other rank's buffer inside init_distributed; after
    a barrier the names can go, and the memory is freed when the processes exit, even on a kill.
    """
    if dist.get_world_size() == 1 or os.environ.get("LOCAL_SIZE") != str(dist.get_world_size()):
        return  # DeepSpeed creates the buffers only when LOCAL_SIZE equals the world size
    dist.barrier()
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


def pin_threads(threads: int | None) -> int:
    """Pin torch's CPU threads (CPU matmul results depend on the count); returns the count used."""
    from deepspeed.accelerator import get_accelerator

    if threads is None:
        threads = 1 if get_accelerator().device_name() == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def shard_groups(size: int):
    """Hybrid sharding: (this rank's shard group, ranks g*K .. g*K+K-1 for K = `size`; its replica group, the
    ranks that hold the same shard: k, k+K, k+2K, ...). Every rank creates every group, in the same order, as
    torch.distributed requires. `size` divides the world size (Topology.create checks it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = replica = None
    for g in range(world // size):
        group = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == rank // size:
            shard = group
    for k in range(size):
        group = dist.new_group(list(range(k, world, size)))
        if k == rank % size:
            replica = group
    return shard, replica


@dataclasses.dataclass(frozen=True)
class Topology:
    """Which ranks share what; made once per job and passed to whoever needs it (docs/scaling.md).

    - `job`: every rank. The step's one all-reduce, the start-up agreement checks, evaluation, summaries,
      checkpoint rotation and barriers.
    - `shard`: the ranks of this rank's ZeRO-3 partition (the whole job unless hybrid sharding): micro-batches
      are dealt over it, and it writes one checkpoint file per rank.
    - `replica_group`: the process group of the ranks that hold the same shard as this one (None when the shard
      group is the job).
    The job is `replicas` equal, contiguous shard groups; this rank is in group `replica`.
    """

    job: Comm
    shard: Comm
    replica_group: object = None

    @property
    def replicas(self) -> int:
        return self.job.world_size // self.shard.world_size

    @property
    def replica(self) -> int:
        return self.job.rank // self.shard.world_size

    @classmethod
    def create(cls, shard_group_size: int | None = None) -> Topology:
        """The job's topology for `shard_group_size` ranks per ZeRO-3 partition (None: the world size). Collective
        when it makes groups (every rank calls it, with the same size)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        size = shard_group_size or world
        if size > world or world % size:
            raise ConfigError(f"shard_group_size={size} must divide the world size {world}: set it to the ranks of "
                              "one node, or leave it unset (the world size)")
        if size == world:
            return cls.of(None)
        return cls.of(*shard_groups(size))

    @classmethod
    def of(cls, shard_group=None, replica_group=None) -> Topology:
        """Around a shard group that exists (None: the whole job); it must be one of equal, contiguous groups."""
        job = Comm(None)
        shard = Comm(shard_group) if shard_group is not None else job
        if job.world_size % shard.world_size or job.rank % shard.world_size != shard.rank:
            raise ValueError("hybrid sharding needs equal, contiguous shard groups (ranks g*K .. g*K+K-1)")
        return cls(job, shard, replica_group)


class GroupMPU:
    """What `deepspeed.initialize(mpu=...)` reads: ZeRO-3 partitions over `group` (the shard group); no model
    parallelism."""

    def __init__(self, group):
        self.group = group

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group)

    def get_model_parallel_group(self):
        return None  # read by DeepSpeed's checkpoint barriers only, which curvzo_ds does not use

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def check_ranks_agree(job: Comm, mine: dict) -> None:
    """Fail on every rank, at start-up, in one line, if the ranks of `job` disagree on what ZOEngine gives as `mine`:
    the configuration ("config"), the trainable blocks ("blocks") or the noise: the generator's identity ("noise")
    and a digest of a reference vector drawn by this rank's own kernel ("kernel"; another kernel build or definition
    draws other bits, and the shards would get inconsistent noise). Collective."""
    everyone = job.all_gather_object(mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == first:
            continue
        diff = sorted(k for k in set(theirs["config"]) | set(first["config"])
                      if theirs["config"].get(k) != first["config"].get(k))
        if diff:
            what = ", ".join(f"{k}: {first['config'].get(k)!r} vs {theirs['config'].get(k)!r}" for k in diff)
        elif theirs["blocks"] != first["blocks"]:
            what = "the trainable parameters (another model, LoRA setting or block_granularity)"
        else:
            what = (f"the noise kernel (reference digest {first['kernel']} vs {theirs['kernel']}, generator "
                    f"{first['noise']['ident']} vs {theirs['noise']['ident']}: another build of curvzo_ds or of "
                    "its kernel)")
        raise RanksDisagree(f"rank {rank} disagrees with rank 0 on {what}. Every rank must start with the same "
                            "seed, configuration, model and curvzo_ds build, or the noise would not match.")
