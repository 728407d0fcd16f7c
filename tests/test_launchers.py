"""Launcher coverage of the ZeRO-3 engine: real SLURM jobs and simulated two-node jobs.

Every run uses test_app's COMMON settings, so every one must give the one-process params_digest.
- SLURM: a module fixture starts a one-node cluster for this machine (munged, slurmctld, slurmd; DESIGN.md §3),
  then `launch/srun.sh` (srun with 2 tasks), `launch/slurm.sbatch` under `sbatch --wait`, and DeepSpeed's hostfile
  launcher with `--launcher slurm` run on it. Without the SLURM packages the tests fail, they do not skip.
- Two nodes on loopback: two `torchrun --nnodes 2` (static and c10d rendezvous) or two
  `accelerate launch --num_machines 2` processes started at once, one per node rank.
- DeepSpeed's hostfile launcher with `--launcher openmpi`, and mpirun ranks agreeing on rank 0's MASTER_PORT.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import CLI, COMMON, ENV, LAUNCH_TIMEOUT, ROOT, SCRIPT_PATH, check_contract, free_port, run_checked

BIN = pathlib.Path(sys.executable).parent
# No launcher variables from the calling shell; this interpreter's bin directory first (`python` in launch/).
BASE_ENV = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")
            and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
BASE_ENV["PATH"] = SCRIPT_PATH

SLURM_CONF = """\
ClusterName=curvzo-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
# The node is named localhost (slurmd -N localhost), so `scontrol show hostnames` gives a name that resolves,
# whatever this machine's hostname is. CPUs=4 lets 2 single-CPU tasks start on a 2-core machine.


def summary_of(out: pathlib.Path) -> dict:
    check_contract(out)
    return json.loads((out / "summary.json").read_text())


def launch(cmd: list[str], out: pathlib.Path, env: dict, log: pathlib.Path | None = None) -> dict:
    """Run one launcher command with the COMMON settings; return the checked summary."""
    run_checked(cmd + COMMON + ["--set", f"output_dir={out}"], env, log=log)
    return summary_of(out)


def launch_nodes(cmds: list[list[str]], out: pathlib.Path, env: dict) -> dict:
    """Start one command per simulated node at once (one process group each); all must succeed."""
    logs = [out.parent / f"{out.name}-node{k}.log" for k in range(len(cmds))]
    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd + COMMON + ["--set", f"output_dir={out}"], env=env, cwd=str(ROOT),
                                          stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for k, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"node {k} exited with {p.returncode}:\n{log.read_text()[-6000:]}"
    return summary_of(out)


def assert_two_ranks_match(summary: dict, digest: str) -> None:
    assert summary["world_size"] == 2 and len(summary["peak_rss_bytes"]) == 2
    assert summary["steps"] == 12
    assert summary["params_digest"] == digest


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> str:
    """params_digest of a plain one-process run (test_app shows every launcher at 2 ranks equals it)."""
    env = {**BASE_ENV, "MASTER_PORT": str(free_port())}
    summary = launch(CLI, tmp_path_factory.mktemp("launchers") / "python-1", env)
    assert summary["world_size"] == 1
    return summary["params_digest"]


def _stop(pid_file: pathlib.Path) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().split()[0])
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster on this machine for the module; yields the environment that reaches it."""
    missing = [b for b in ("munge", "munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "scancel")
               if shutil.which(b) is None]
    if missing:
        pytest.fail(f"SLURM is not installed ({', '.join(missing)} not found): apt-get install slurmctld slurmd "
                    "slurm-client munge (.ci/run does it)")
    if os.geteuid() != 0:
        pytest.fail("the SLURM tests start munged, slurmctld and slurmd, and need root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], dir=d, ctld_port=free_port(),
                                      slurmd_port=free_port()))
    env = {**BASE_ENV, "SLURM_CONF": str(conf)}
    munge_pid = None
    try:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:  # no munged answering yet
            subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "/run/munge"], check=True)
            subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=30)
            munge_pid = pathlib.Path("/run/munge/munged.pid")
        subprocess.run(["slurmctld", "-c", "-f", str(conf)], env=env, check=True, timeout=30)
        subprocess.run(["slurmd", "-f", str(conf), "-N", "localhost"], env=env, check=True, timeout=30)
        state = ""
        for _ in range(120):
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,
                                   text=True).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            logs = "".join(f"\n--- {n}\n" + (d / n).read_text()[-3000:] for n in ("slurmctld.log", "slurmd.log")
                           if (d / n).exists())
            pytest.fail(f"the SLURM node did not become idle in 60 s (sinfo: {state!r}){logs}")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
        _stop(d / "slurmd.pid")
        _stop(d / "slurmctld.pid")
        if munge_pid is not None:
            _stop(munge_pid)
        for sub in ("state", "spool"):
            shutil.rmtree(d / sub, ignore_errors=True)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_srun_two_tasks_give_the_one_process_result(slurm, one_rank, tmp_path):
    # launch/srun.sh is `srun --ntasks $NPROC python -m curvzo_ds.cli train "$@"`; MASTER_ADDR comes from
    # `scontrol show hostnames` inside curvzo_ds.distributed.
    env = {**slurm, "NPROC": "2", "MASTER_PORT": str(free_port())}
    summary = launch(["bash", str(ROOT / "launch" / "srun.sh")], tmp_path / "srun", env)
    assert_two_ranks_match(summary, one_rank)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_sbatch_script_gives_the_one_process_result(slurm, one_rank, tmp_path):
    script = ROOT / "launch" / "slurm.sbatch"
    sruns = [line for line in script.read_text().splitlines() if line.lstrip().startswith("srun ")]
    assert len(sruns) == 1 and "python -m curvzo_ds.cli train" in sruns[0], sruns
    # The script's own resources (2 nodes x 8 GPUs) made test-sized on the command line; MASTER_ADDR is
    # set by the script from `scontrol show hostnames`.
    log = tmp_path / "job.out"
    cmd = ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
           "--time=10", f"--output={log}", f"--chdir={ROOT}", str(script)]
    summary = launch(cmd, tmp_path / "sbatch", {**slurm, "MASTER_PORT": str(free_port())}, log=log)
    assert_two_ranks_match(summary, one_rank)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_batch_script_is_one_rank_and_its_srun_tasks_are_ranks(slurm, tmp_path):
    # The batch step itself has SLURM_PROCID=0 and SLURM_NTASKS=2: it must not count as rank 0 of 2.
    log = tmp_path / "kind.out"
    probe = "python -c 'from curvzo_ds.distributed import launcher_kind; print(launcher_kind())'"
    proc = subprocess.run(["sbatch", "--wait", "--ntasks=2", "--time=2", f"--output={log}", f"--chdir={ROOT}",
                           f"--wrap={probe}; srun {probe}"], env=slurm, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + (log.read_text() if log.exists() else "")
    assert log.read_text().split() == ["single", "slurm", "slurm"]


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", ["openmpi", "slurm"])
def test_deepspeed_hostfile_launchers(request, one_rank, tmp_path, launcher):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    port = str(free_port())
    # Neither launcher passes --master_port on to the ranks: the ranks read MASTER_PORT from the environment.
    env = {**(request.getfixturevalue("slurm") if launcher == "slurm" else BASE_ENV), "MASTER_PORT": port}
    # One host in the hostfile: --force_multi makes DeepSpeed use the multi-node launcher anyway, and
    # --no_ssh_check skips its ssh probe (the launchers here need no ssh).
    cmd = [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--force_multi", "--no_ssh_check", "--launcher",
           launcher, "--master_addr", "127.0.0.1", "--master_port", port]
    if launcher == "openmpi":
        root = "--allow-run-as-root " if os.geteuid() == 0 else ""
        cmd += ["--launcher_args", root + "--oversubscribe --mca btl_tcp_if_include lo", "--module", "curvzo_ds.cli"]
    else:
        cmd += [str(BIN / "curvzo-ds")]  # DeepSpeed 0.19.8's slurm launcher drops --module: give it a script
    summary = launch(cmd + ["train"], tmp_path / launcher, env)
    assert_two_ranks_match(summary, one_rank)


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_torchrun_nodes_give_the_one_process_result(one_rank, tmp_path, rdzv):
    port = str(free_port())
    if rdzv == "static":
        where = ["--master_addr", "127.0.0.1", "--master_port", port]
    else:
        where = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "curvzo-test"]
    cmds = [[str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(k), *where,
             "-m", "curvzo_ds.cli", "train"] for k in (0, 1)]
    assert_two_ranks_match(launch_nodes(cmds, tmp_path / "torchrun", BASE_ENV), one_rank)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_two_accelerate_machines_give_the_one_process_result(one_rank, tmp_path):
    # --num_processes is the total over all machines. Under DeepSpeed, Accelerate's default multi-node
    # launcher is pdsh from machine 0 alone; `standard` (torchrun on every machine) is the per-machine form.
    port = free_port()  # one rendezvous port for both machines
    cmds = [[str(BIN / "accelerate"), "launch", "--config_file", str(ROOT / "ds_configs" / "accelerate_zero3.yaml"),
             "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(k), "--main_process_ip",
             "127.0.0.1", "--main_process_port", str(port), "--deepspeed_multinode_launcher", "standard",
             "-m", "curvzo_ds.cli", "train"] for k in (0, 1)]
    assert_two_ranks_match(launch_nodes(cmds, tmp_path / "accelerate", BASE_ENV), one_rank)


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_mpirun_ranks_take_rank_0s_master_port():
    # Open MPI passes no environment to remote ranks unless told (-x): only rank 0 has MASTER_PORT here, and
    # every rank must use it (DeepSpeed's MPI discovery alone would use 29500 on all of them).
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is not installed (apt-get install openmpi-bin; .ci/run does it)")
    # flush=True: the line and its newline leave in one write, so the two ranks' lines cannot interleave.
    probe = ("import os, torch.distributed as dist; from curvzo_ds.distributed import init_distributed; "
             "init_distributed(); print(dist.get_world_size(), os.environ['MASTER_PORT'], flush=True)")
    port = free_port()
    rank0_port = f'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then export MASTER_PORT={port}; fi; exec "$0" -c "$1"'
    cmd = [shutil.which("mpirun"), "-np", "2", "--oversubscribe", "-x", "PYTHONPATH", "-x", "DS_ACCELERATOR",
           "bash", "-c", rank0_port, sys.executable, probe]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, env=BASE_ENV, cwd=str(ROOT), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("2 ")] == [f"2 {port}"] * 2, proc.stdout
