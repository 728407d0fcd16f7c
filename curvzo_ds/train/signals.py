"""Pre-emption and fault injection for the training loop (docs/reliability.md).

`StopRequest`: SIGTERM, SIGINT and SIGUSR1 (SLURM's `--signal`, a scheduler's pre-emption, Ctrl-C) set a
flag on the rank that receives them. The loop hands the flag to `ZOEngine.step`, which sums it over the
ranks inside the step's own all-reduce: at the next step boundary every rank knows that one of them was
asked to stop, saves the same checkpoint, and the process exits with EXIT_PREEMPTED. A second Ctrl-C stops
at once.

`Fault`: CURVZO_DS_FAULT="kind@step[:rank]" makes one rank misbehave at a step, so that the tests can show
the run's reaction with real processes: `nan` (that rank's losses are NaN), `hang` (it sleeps in the loop,
so the others wait in a collective until ddp_timeout), `desync` (its ZO scores change, which the
consistency check must catch). The training loop runs each update inside `Fault.around_step`; the engine is
built without it. Unset (always, outside tests), it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

log = logging.getLogger("curvzo_ds")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Catches SIGTERM, SIGINT and SIGUSR1 for the body of a `with` (main thread only; elsewhere it does nothing)."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signal_name = name
        log.warning("%s received: the run stops at the next step boundary, after saving a checkpoint", name)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class Fault:
    """CURVZO_DS_FAULT="kind@step[:rank]" (tests only): kind nan, hang or desync at update `step` on `rank`."""

    KINDS = ("nan", "hang", "desync")

    def __init__(self, rank: int, spec: str | None = None):
        spec = os.environ.get("CURVZO_DS_FAULT", "") if spec is None else spec
        self.kind = self.step = None
        if spec:
            kind, _, where = spec.partition("@")
            step, _, on_rank = where.partition(":")
            if kind not in self.KINDS or not step.isdigit():
                raise ValueError(f"CURVZO_DS_FAULT={spec!r}: use kind@step[:rank] with kind in {self.KINDS}")
            if not on_rank or int(on_rank) == rank:
                self.kind, self.step = kind, int(step)

    def at(self, kind: str, step: int) -> bool:
        return self.kind == kind and self.step == step

    @contextlib.contextmanager
    def around_step(self, engine, step: int):
        """The body of a `with` is update `step` (1-based): the loop's only hook. `hang` sleeps and `desync` changes
        this rank's scores before it; `nan` makes this rank's losses NaN during it (the engine's loss function is
        swapped for the body and restored after). Without a fault for this step it does nothing."""
        self.before_step(engine, step)
        if not self.at("nan", step):
            yield
            return
        loss_fn = engine.loss_fn

        def faulty(model, batch):
            loss_sum, count = loss_fn(model, batch)
            return loss_sum * float("nan"), count

        engine.loss_fn = faulty
        try:
            yield
        finally:
            engine.loss_fn = loss_fn

    def before_step(self, engine, step: int) -> None:
        if self.at("hang", step):
            log.warning("fault injection: hanging before step %d", step)
            time.sleep(3600)
        if self.at("desync", step):
            log.warning("fault injection: changing this rank's scores before step %d", step)
            engine.sampler.scores = engine.sampler.scores * 2 + 1
