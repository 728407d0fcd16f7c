"""Pre-emption and fault injection for the training loop (docs/reliability.md).

`StopRequest`: SIGTERM, SIGINT and SIGUSR1 (SLURM's `--signal`, a scheduler's pre-emption, Ctrl-C) set a flag on the
rank that receives them; the handler does nothing else (no logging, no lock) but acknowledge the first signal at
once in one line (one os.write to stderr, rank 0), and the loop logs the request at its next pass. The loop hands
the flag to `ZOEngine.step`, which sums it over the ranks inside the step's own all-reduce: at the next step
boundary every rank knows that one of them was asked to stop, saves the same checkpoint, and the process exits with
EXIT_PREEMPTED. However many signals arrive together (a terminal's Ctrl-C and a launcher's relay of it), a rank
makes one stop request of them; a SIGINT or SIGTERM that arrives `STOP_NOW_AFTER` seconds or more after the first
stops at once (KeyboardInterrupt, exit 130), SIGUSR1 never does. A rank started by a launcher also stops at the next
step boundary, with a checkpoint, when that launcher is gone (its parent process changed): no rank outlives its
launcher.

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


# A second SIGINT or SIGTERM this many seconds (or more) after a rank's first stop signal stops it at once; the
# signals that arrive together from a terminal, a launch script and a launcher all come within it (docs/reliability.md).
STOP_NOW_AFTER = 5.0


class StopRequest:
    """Catches SIGTERM, SIGINT and SIGUSR1 for the body of a `with` (main thread only; elsewhere it does nothing).

    `watch_parent`: this rank was started by a launcher; `poll()` then also requests a stop once the parent process
    is gone (the rank was re-parented), so that a rank whose launcher died stops at the next step boundary."""

    def __init__(self, watch_parent: bool = False):
        self.first: int | None = None  # the first stop signal's number
        self.first_at: float | None = None  # when it came (time.monotonic)
        self.interrupted = False  # a SIGINT came (Ctrl-C): the stop line names it, whatever came with it
        self.parent_gone: int | None = None  # the pid of the launcher that went away
        self.announced = False
        self._parent = os.getppid() if watch_parent else None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.first is not None or self.parent_gone is not None

    @property
    def signal_name(self) -> str | None:
        """The signal the user sent: SIGINT when a Ctrl-C came (a launcher relays it as SIGTERM), else the first."""
        if self.first is None:
            return None
        return "SIGINT" if self.interrupted else signal.Signals(self.first).name

    def reason(self) -> str:
        """Why this rank stops, for the stop line: `a signal (SIGINT)`, or its launcher gone. A rank stopped by another
        rank's request looks at its own launcher again first: when another rank saw the launcher go at its step
        boundary before this one did, this one's is gone too (a killed torchrun leaves every rank)."""
        if self.first is not None:
            return f"on a signal ({self.signal_name})"
        self._notice_parent()
        if self.parent_gone is not None:
            return f"because its launcher (pid {self.parent_gone}) is gone"
        return "on a signal (received by another rank)"

    def _notice_parent(self) -> None:
        if self._parent is not None and self.parent_gone is None and os.getppid() != self._parent:
            self.parent_gone = self._parent

    def _handle(self, signum, frame) -> None:
        # A flag, a time and one os.write: the handler may run between any two bytecodes of the main thread, in the
        # middle of a log write or under a lock that it would then wait for.
        now = time.monotonic()
        if signum == signal.SIGINT:
            self.interrupted = True
        if self.first is None:
            self.first, self.first_at = signum, now
            self._acknowledge(signum)
        elif signum != signal.SIGUSR1 and now - self.first_at >= STOP_NOW_AFTER:
            raise KeyboardInterrupt  # asked again, well after the first: stop now (cli.entry: one line, exit 130)

    def _acknowledge(self, signum: int) -> None:
        """The first signal's one line, at once (a step can take minutes): one os.write to stderr, the handler's only
        output (no logging: its lock may be held by the code the handler interrupted). Rank 0 only (every rank of a
        launched job gets the signal), or a rank that is alone."""
        if os.environ.get("RANK", "0") != "0":
            return
        name = signal.Signals(signum).name
        again = ("" if signum == signal.SIGUSR1 else
                 f" (another SIGINT or SIGTERM {STOP_NOW_AFTER:g} s or more after this one stops at once, saving "
                 "nothing)")
        line = (f"curvzo-ds: {name} received: the run stops at the end of the step in progress, after saving a "
                f"checkpoint{again}\n")
        with contextlib.suppress(OSError):
            os.write(2, line.encode())

    def poll(self) -> None:
        """At a step boundary (the loop's): notice a launcher that is gone, and announce a new request once."""
        self._notice_parent()
        if self.requested and not self.announced:
            self.announced = True
            log.warning("%s: the run stops at the next step boundary, after saving a checkpoint%s",
                        f"{self.signal_name} received" if self.first is not None else
                        f"the launcher (pid {self.parent_gone}) is gone",
                        f" (another SIGINT or SIGTERM {STOP_NOW_AFTER:g} s or more after this one stops at once)"
                        if self.first is not None else "")

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
