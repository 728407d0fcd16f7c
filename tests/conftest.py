import os

import pytest

from tests import launches

# This machine has no model hub: a hub id fails at once instead of after ~25 s of retries (subprocesses inherit it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Fixtures that train through the CLI in a subprocess: the tests that use them are end-to-end, slow tier.
RUN_FIXTURES = {"straight", "lora_run", "real_run", "reference", "slurm", "quant_run"}


# Every interpreter the tests start logs its start (tests/launches.py), also one started with os.environ as it is.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(launches.HOOK_DIR), os.environ.get("PYTHONPATH")) if p)


class LaunchCounter:
    """Attributes launches to the test or shared fixture running (tests/launches.py). A plugin of its own: hooks in
    this conftest would not see the set-up of session-scoped fixtures, which pytest runs at the root's level."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        launches.push(item.nodeid)
        yield
        launches.pop()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        """Launches made while a shared fixture is set up belong to it, whichever test needed it first."""
        shared = fixturedef.scope != "function"
        if shared:
            launches.push(f"fixture:{fixturedef.baseid + '::' if fixturedef.baseid else ''}{fixturedef.argname}")
        yield
        if shared:
            launches.pop()

    def pytest_sessionfinish(self, session, exitstatus):
        if not session.config.pluginmanager.has_plugin("dsession"):  # pytest-xdist's controller starts only workers
            launches.settle()
        recorded = launches.load()
        if os.environ.get("CURVZO_RECORD_LAUNCHES"):
            launches.save(recorded)
            return
        over = launches.excess(recorded) + getattr(session.config, "_curvzo_launch_excess", [])
        if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: the controller reports and fails
            session.config.workeroutput["curvzo_launch_excess"] = over
        elif over:
            session.config._curvzo_launch_excess = over
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        """pytest-xdist's controller: a worker's launches above the record fail the run as a serial run's do."""
        over = getattr(node, "workeroutput", {}).get("curvzo_launch_excess", [])
        config = node.config
        config._curvzo_launch_excess = getattr(config, "_curvzo_launch_excess", []) + over

    def pytest_unconfigure(self, config):
        launches.remove_log()


def pytest_configure(config):
    if os.environ.get("CURVZO_RECORD_LAUNCHES") and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("CURVZO_RECORD_LAUNCHES=1 records the launches of one process: add -n 0")
    config.pluginmanager.register(LaunchCounter(), "curvzo-launch-counter")


# The files with the longest total time, longest first (measured: docs/testing.md). tools/test.sh runs the suite in
# two pytest-xdist workers that take whole files in collection order, so a long file started last would run alone
# at the end; the rest follow in their usual order.
SLOWEST_FIRST = ["test_reliability", "test_launchers", "test_zero3", "test_app", "test_benchmarks", "test_plan",
                 "test_integrations", "test_docs_figures", "test_perturb", "test_engine", "test_real_model",
                 "test_user_paths", "test_eval", "test_hybrid"]


def pytest_collection_modifyitems(config, items):
    """Multi-rank tests and tests on a CLI training run are in the slow tier: `python -m pytest -m "not slow"` is
    the unit tier (README.md and docs/testing.md have its measured time). Tests marked `gpu`
    are deselected where CUDA is absent, and the run says how many: they are never skipped silently
    (`python -m pytest -m gpu` runs them on a GPU machine)."""
    import torch

    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each file's own order is kept
    for item in items:
        if item.get_closest_marker("multirank") or RUN_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if not torch.cuda.is_available():
        gpu = [item for item in items if item.get_closest_marker("gpu")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu")]
            config._curvzo_gpu_deselected = len(gpu)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = getattr(config, "_curvzo_launch_excess", [])
    if over:
        terminalreporter.write_line("FAILED: launches above tests/launches.json (tests/launches.py: record "
                                    "a new test's with CURVZO_RECORD_LAUNCHES=1)", red=True)
        for line in over:
            terminalreporter.write_line(f"  {line}", red=True)
    count = getattr(config, "_curvzo_gpu_deselected", 0)
    if count:
        terminalreporter.write_line(f"{count} tests marked gpu deselected: no CUDA device here "
                                    "(run `python -m pytest -m gpu` on a GPU machine; tools/gpu_run.sh does)")


@pytest.fixture(scope="session")
def one_rank_group():
    """Rank 0 of a 1-rank job in this process, for deepspeed.initialize. The process group is made once and kept
    for the session: DeepSpeed keeps the first group it sees, so a group destroyed and made again breaks the next
    initialize in the same process ("Group ... is not registered")."""
    import torch.distributed as dist

    from tests.helpers import free_port

    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               DS_ACCELERATOR="cpu")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=0, world_size=1)
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A Hugging Face directory of the demo Llama with tied embeddings (as SmolLM2: the tied embedding counts once)
    and its tokenizer, random weights of seed 0: the experiments' tests run their scripts on it."""
    import torch
    from transformers import AutoModelForCausalLM

    from curvzo_ds.tasks import demo_model_config, load_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    conf = demo_model_config("llama")
    conf.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf).save_pretrained(path)
    load_tokenizer("llama").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The reference run of the helpers' COMMON settings: one process, 12 steps (shared by test files)."""
    from tests.helpers import train

    out = tmp_path_factory.mktemp("app") / "straight-1"
    return out, train("python", 1, out)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node SLURM cluster for the session (tests/slurm_cluster.py); yields the environment that reaches it."""
    from tests.slurm_cluster import cluster

    yield from cluster(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> str:
    """params_digest of the uninterrupted run of helpers.RUN (one process; every world size gives the same)."""
    import json

    from tests.helpers import CLI, ENV, ROOT, RUN, run_cli

    out = tmp_path_factory.mktemp("reliability") / "straight"
    proc = run_cli(CLI + RUN + ["--set", f"output_dir={out}"], env=ENV, cwd=str(ROOT), capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())["params_digest"]
