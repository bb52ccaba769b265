"""The GIL switch interval a DynamicBatcher sets while it is open (``compiler.serve.switching``); what it buys is
measured by ``benchmarks/serving_gpu.py`` (its threads cells, at the default and at CPython's 5 ms)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from compiler.core import defaults
from compiler.serve.batcher import DynamicBatcher
from compiler.serve.engines import Engines


@pytest.fixture
def interval() -> Iterator[None]:
    """CPython's default interval (5 ms) before the test, the test's interval restored after it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_the_first_batcher_shortens_the_interval_and_the_last_restores_it(engines: Engines, interval: None) -> None:
    """Proves: an open batcher runs with the default interval (0.5 ms, shorter than the 5 ms found); a second one
    keeps it; closing the first leaves it while the second is open; closing the last restores 5 ms; closing twice
    gives nothing back twice."""
    first = DynamicBatcher(engines, max_wait_ms=1)
    assert sys.getswitchinterval() == pytest.approx(defaults.SWITCH_INTERVAL_S)
    second = DynamicBatcher(engines, max_wait_ms=1)
    first.close()
    first.close()
    assert sys.getswitchinterval() == pytest.approx(defaults.SWITCH_INTERVAL_S)
    second.close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_interval_is_left_alone_when_asked_or_already_short(engines: Engines, interval: None) -> None:
    """Proves: switch_interval=None changes nothing; an interval already shorter than the default is neither raised
    while the batcher is open nor changed by its close; a value the user sets while a batcher is open survives its
    close."""
    with DynamicBatcher(engines, max_wait_ms=1, switch_interval=None):
        assert sys.getswitchinterval() == pytest.approx(0.005)
    sys.setswitchinterval(0.0001)
    with DynamicBatcher(engines, max_wait_ms=1):
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    sys.setswitchinterval(0.005)
    with DynamicBatcher(engines, max_wait_ms=1):
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)
