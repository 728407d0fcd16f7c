"""A one-node SLURM cluster on this machine (munged, slurmctld, slurmd; docs/multinode.md) for the tests that run real
SLURM jobs (conftest.py's session fixture `slurm`). Without the SLURM packages, or without root, those tests fail:
they do not skip."""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

import pytest

from tests.helpers import BASE_ENV, free_port

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


def cluster(tmp_path_factory):
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
