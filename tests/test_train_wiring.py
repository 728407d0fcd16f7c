"""The training job's wiring (issue 36): the test-only fault lives in the loop, not in the engine it builds."""

import math
import types

import pytest

from curvzo_ds.train.signals import Fault


def _engine():
    return types.SimpleNamespace(loss_fn=lambda model, batch: (2.0, 1), step_count=0)


def test_a_nan_fault_wraps_only_the_named_update_and_leaves_the_engine_as_built():
    engine, fault = _engine(), Fault(rank=1, spec="nan@3:1")
    built = engine.loss_fn
    for step in (1, 2, 3, 4):
        with fault.around_step(engine, step):
            loss, count = engine.loss_fn(None, None)
        assert count == 1 and math.isnan(loss) == (step == 3)
        assert engine.loss_fn is built  # restored after the update


def test_a_fault_for_another_rank_or_none_does_nothing():
    engine = _engine()
    built = engine.loss_fn
    for fault in (Fault(rank=0, spec="nan@1:1"), Fault(rank=0, spec="")):
        with fault.around_step(engine, 1):
            assert engine.loss_fn is built


def test_a_bad_fault_spec_is_refused():
    with pytest.raises(ValueError, match="kind@step"):
        Fault(rank=0, spec="boom@1")
