"""Launcher coverage of the ZeRO-3 engine: real SLURM jobs and simulated two-node jobs.

Every run uses test_app's COMMON settings, so every one must give the one-process params_digest.
- SLURM: a session fixture (conftest.py, tests/slurm_cluster.py) starts a one-node cluster on this machine,
  then `launch/srun.sh` (srun with 2 tasks), `launch/slurm.sbatch` under `sbatch --wait`, and DeepSpeed's hostfile
  launcher with `--launcher slurm` run on it. Without the SLURM packages the tests fail, they do not skip.
- Two nodes on loopback: two `torchrun --nnodes 2` (static and c10d rendezvous) or two
  `accelerate launch --num_machines 2` processes started at once, one per node rank.
- DeepSpeed's hostfile launcher with `--launcher openmpi`, and mpirun ranks agreeing on rank 0's MASTER_PORT.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import (
    BASE_ENV,
    CLI,
    COMMON,
    LAUNCH_TIMEOUT,
    ROOT,
    SAVE,
    TOTAL,
    check_contract,
    checkpoints,
    finish,
    free_port,
    log_of,
    resume,
    run_checked,
    start,
    wait_for_steps,
)

BIN = pathlib.Path(sys.executable).parent


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


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_srun_two_tasks_give_the_one_process_result(slurm, one_rank, tmp_path):
    # launch/srun.sh is `srun --ntasks $NPROC python -m curvzo_ds.cli train "$@"`; MASTER_ADDR comes from
    # `scontrol show hostnames` inside curvzo_ds.shard.distributed.
    env = {**slurm, "NPROC": "2", "MASTER_PORT": str(free_port())}
    summary = launch(["bash", str(ROOT / "launch" / "srun.sh")], tmp_path / "srun", env)
    assert_two_ranks_match(summary, one_rank)


def _sbatch(log: pathlib.Path, *options: str) -> list[str]:
    """sbatch --wait of launch/slurm.sbatch made test-sized (its own resources are 2 nodes x 8 GPUs)."""
    return ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
            "--time=30", f"--output={log}", f"--chdir={ROOT}", *options, str(ROOT / "launch" / "slurm.sbatch")]


def _squeue(env: dict, job: str) -> list[str]:
    """The job's state and reason, as squeue prints them (["PENDING", "BeginTime"])."""
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True,
                          text=True).stdout.split()


def _job_id(env: dict) -> str:
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
    assert len(jobs) == 1, jobs
    return jobs[0]


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_sigterm_to_srun_saves_at_a_step_boundary_and_resume_is_exact(slurm, reference, tmp_path):
    """SIGTERM to launch/srun.sh (srun passes it to every task): a checkpoint at a step boundary, exit 3, and
    --resume gives the uninterrupted run's digest. (A signal to the batch script of launch/slurm.sbatch, TERM or
    the --signal=B:USR1 warning, goes through one trap: the requeue test below sends it.)"""
    out = tmp_path / "srun"
    env = {**slurm, "NPROC": "2", "MASTER_PORT": str(free_port())}
    proc = start(["bash", str(ROOT / "launch" / "srun.sh")], out, env=env)
    wait_for_steps(out, proc, 20)
    os.kill(proc.pid, signal.SIGTERM)  # srun.sh execs srun
    code = finish(proc)
    text = log_of(out)
    assert code == 3 and "stopped on a signal (SIG" in text, f"exit {code}:\n{text[-3000:]}"
    saved = checkpoints(out)
    assert saved and 20 <= saved[-1] < TOTAL and saved[-1] % SAVE != 0, saved  # a boundary, not a regular save
    assert resume(out)["params_digest"] == reference


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_a_requeued_sbatch_job_resumes_by_itself(slurm, reference, tmp_path):
    """launch/slurm.sbatch under sbatch, made test-sized on the command line (MASTER_ADDR comes from `scontrol show
    hostnames`), with CURVZO_REQUEUE=1. The time-limit warning (--signal=B:USR1, sent here by scancel) reaches the
    script's trap, which passes it to the ranks: both stop at a step boundary with a checkpoint, the job requeues
    itself, and its second run resumes from the checkpoint (SLURM_RESTART_COUNT) to the uninterrupted one-process
    digest at 2 ranks."""
    script = ROOT / "launch" / "slurm.sbatch"
    sruns = [line for line in script.read_text().splitlines() if line.lstrip().startswith("srun ")]
    assert len(sruns) == 1 and "python -m curvzo_ds.cli train" in sruns[0], sruns
    out, job_log = tmp_path / "requeue", tmp_path / "job.out"
    env = {**slurm, "MASTER_PORT": str(free_port()), "CURVZO_REQUEUE": "1"}
    proc = start(_sbatch(job_log, "--open-mode=append"), out, env=env)
    wait_for_steps(out, proc, 20)
    job = _job_id(slurm)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    deadline = time.monotonic() + 240  # the second run takes about 20 s here
    seen, held_since, released_at = [], None, 0.0
    while not (out / "summary.json").exists() and time.monotonic() < deadline:
        # SLURM holds a requeued job back (its begin time, about 2 minutes) before it may start again: on this
        # one-job test cluster that is only waiting, so the test lets it start sooner. Not at once: slurmd revokes
        # the first run's job credential when it ends, and a start within that second was killed as "non-startable:
        # Job credential revoked" (CI, 2026-11-29). A node left draining is returned to service.
        state = _squeue(slurm, job)
        node = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=slurm, capture_output=True, text=True).stdout
        seen.append(f"{state} / node {node.strip()}")
        now = time.monotonic()
        if state[:2] == ["PENDING", "BeginTime"]:
            held_since = held_since or now
            if now - held_since >= 5 and now - released_at >= 10:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True)
                released_at = now
        if any(s in node for s in ("drain", "down")):
            subprocess.run(["scontrol", "update", "NodeName=localhost", "State=RESUME"], env=slurm)
        time.sleep(1)
    finish(proc, timeout=60)
    text = log_of(out) + (job_log.read_text() if job_log.exists() else "")
    ctld = pathlib.Path(slurm["SLURM_CONF"]).parent / "slurmctld.log"
    assert (out / "summary.json").exists(), "\n".join(
        [text[-3000:], "job / node states, one per second, deduplicated:", *dict.fromkeys(seen),
         "slurmctld.log:", ctld.read_text()[-2000:] if ctld.exists() else "(none)"])
    assert "requeueing job" in text and "resumed from" in text, text[-4000:]
    stops = re.findall(r"^curvzo-ds train: stopped on a signal \(SIGUSR1\) at step (\d+)", text, re.M)
    assert len(stops) == 2 and len(set(stops)) == 1, text[-4000:]  # both ranks, at one step
    assert 20 <= int(stops[0]) < TOTAL and int(stops[0]) % SAVE != 0, stops  # a boundary, not a regular save
    summary = summary_of(out)
    assert summary["world_size"] == 2 and summary["params_digest"] == reference


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_batch_script_is_one_rank_and_its_srun_tasks_are_ranks(slurm, tmp_path):
    # The batch step itself has SLURM_PROCID=0 and SLURM_NTASKS=2: it must not count as rank 0 of 2.
    log = tmp_path / "kind.out"
    probe = "python -c 'from curvzo_ds.shard.distributed import launcher_kind; print(launcher_kind())'"
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
def test_mpirun_ranks_take_rank_0s_master_port(tmp_path):
    # Open MPI passes no environment to remote ranks unless told (-x): only rank 0 has MASTER_PORT here, and
    # every rank must use it (DeepSpeed's MPI discovery alone would use 29500 on all of them).
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is not installed (apt-get install openmpi-bin; .ci/run does it)")
    # Each rank writes its own file: mpirun forwards the ranks' stdout in pieces, which can interleave (seen: "22 P").
    said = tmp_path / "said"
    said.mkdir()
    probe = ("import os, pathlib, sys, torch.distributed as dist; "
             "from curvzo_ds.shard.distributed import init_distributed; init_distributed(); "
             "pathlib.Path(sys.argv[1], str(dist.get_rank())).write_text("
             "str(dist.get_world_size()) + ' ' + os.environ['MASTER_PORT']); dist.barrier(); "
             "dist.destroy_process_group()")  # without it the ranks' exit waited about 50 s
    port = free_port()
    rank0_port = f'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then export MASTER_PORT={port}; fi; exec "$0" -c "$1" "$2"'
    cmd = [shutil.which("mpirun"), "-np", "2", "--oversubscribe", "-x", "PYTHONPATH", "-x", "DS_ACCELERATOR",
           "bash", "-c", rank0_port, sys.executable, probe, str(said)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, env=BASE_ENV, cwd=str(ROOT), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(said / str(r)).read_text() for r in (0, 1)] == [f"2 {port}"] * 2


def test_deepspeeds_op_is_built_with_this_environments_ninja(monkeypatch):
    """mpirun puts its own bin directory first on its ranks' PATH (/usr/bin here, with ninja 1.11 beside pip's
    1.13): each ninja rebuilt the other's build of DeepSpeed's CPU op, a minute or more per switch of launcher.
    init_distributed builds it with this environment's ninja, whatever PATH the launcher gave."""
    import ninja  # pip's, a DeepSpeed requirement

    from curvzo_ds.startup import environment_ninja_first

    own = pathlib.Path(ninja.BIN_DIR, "ninja")
    assert own.exists(), own
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with environment_ninja_first():
        assert shutil.which("ninja") == str(own)
    assert os.environ["PATH"] == "/usr/bin:/bin"
