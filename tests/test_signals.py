"""The stop request of a training rank (curvzo_ds/train/signals.py, docs/reliability.md), in one process: the
handler only sets a flag; signals that come together are one request; a SIGINT or SIGTERM STOP_NOW_AFTER seconds
after the first stops at once; the stop line names a Ctrl-C; a rank whose launcher is gone stops. The real
processes (a terminal's Ctrl-C to launch/torchrun.sh, a killed torchrun) are in tests/test_reliability.py."""

import logging
import os
import signal

import pytest

from curvzo_ds.train import signals
from curvzo_ds.train.signals import STOP_NOW_AFTER, StopRequest


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(signals.time, "monotonic", clock)
    return clock


def test_signals_that_come_together_are_one_request_named_for_the_ctrl_c(clock, caplog):
    """torchrun's SIGTERM and the terminal's SIGINT at once (the issue's exit 1 without a checkpoint): one request,
    no KeyboardInterrupt, and the stop line names SIGINT, the signal the user sent."""
    stop = StopRequest()
    with caplog.at_level(logging.WARNING, logger="curvzo_ds"):
        stop._handle(signal.SIGTERM, None)
        assert caplog.records == []  # the handler logs nothing: the loop does, at its next pass
        clock.now += STOP_NOW_AFTER - 0.5
        stop._handle(signal.SIGINT, None)
        stop._handle(signal.SIGTERM, None)
        assert stop.requested and stop.signal_name == "SIGINT" and stop.reason() == "on a signal (SIGINT)"
        stop.poll()
        stop.poll()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("SIGINT received: the run stops at the next step boundary")


def test_a_second_ctrl_c_after_the_grace_interval_stops_at_once_and_sigusr1_never_does(clock):
    stop = StopRequest()
    stop._handle(signal.SIGUSR1, None)
    clock.now += 10 * STOP_NOW_AFTER
    stop._handle(signal.SIGUSR1, None)  # SLURM's warning signal, again: still the one request
    assert stop.signal_name == "SIGUSR1"
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    other = StopRequest()
    other._handle(signal.SIGTERM, None)
    clock.now += STOP_NOW_AFTER
    with pytest.raises(KeyboardInterrupt):
        other._handle(signal.SIGTERM, None)


def test_a_rank_whose_launcher_is_gone_stops_and_one_started_alone_is_not_watched(monkeypatch):
    parent = os.getppid()
    watched, alone = StopRequest(watch_parent=True), StopRequest()
    watched.poll()
    assert not watched.requested
    # re-parented (to init or a subreaper): the launcher is gone. Not pid 1 itself: a pytest started with nohup
    # from a shell that has exited is init's child already.
    monkeypatch.setattr(signals.os, "getppid", lambda: parent + 1)
    watched.poll()
    alone.poll()
    assert watched.requested and watched.signal_name is None and not alone.requested
    assert watched.reason() == f"because its launcher (pid {parent}) is gone"


def test_a_rank_stopped_by_another_rank_names_its_own_launcher_gone_when_it_is(monkeypatch):
    """CI's race (2026-11-30): torchrun killed, rank 1 saw it at its step boundary first, so rank 0 stopped on the
    all-reduced request with no reason of its own and said "on a signal"; by its stop line its launcher is gone too."""
    parent = os.getppid()
    stopped_by_other = StopRequest(watch_parent=True)
    assert stopped_by_other.reason() == "on a signal (received by another rank)"
    monkeypatch.setattr(signals.os, "getppid", lambda: parent + 1)
    assert stopped_by_other.reason() == f"because its launcher (pid {parent}) is gone"
    assert StopRequest().reason() == "on a signal (received by another rank)"  # not watched


def test_the_handlers_are_installed_for_the_body_only():
    before = {sig: signal.getsignal(sig) for sig in signals.SIGNALS}
    with StopRequest() as stop:
        assert all(signal.getsignal(sig) == stop._handle for sig in signals.SIGNALS)
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal: the flag, and nothing else
        assert stop.requested and stop.signal_name == "SIGUSR1"
    assert {sig: signal.getsignal(sig) for sig in signals.SIGNALS} == before
