"""The interpreter's GIL switch interval while batchers run: shorter than CPython's 5 ms, set by the first batcher
and given back by the last.

A thread that asks for the GIL while another runs Python waits until that one blocks, or until the switch interval
has passed and it is asked to let go. A ``DynamicBatcher``'s threads start and answer batches between its callers'
bursts of Python (64 client threads answered at once, an event loop resuming its coroutines): each hand-off could
wait up to 5 ms, once or twice per batch. On an H200 host, 64 threads calling ``submit`` served 5,164 req/s at a
p99 of 15.7 ms with 0.5 ms against 4,810 at 18.7 ms with 5 ms (ONNX Runtime's CUDA provider, one context), and torch
with CUDA graphs 3,588 at 23.0 ms against 3,465 at 28.4 ms (``benchmarks/serving_gpu.py``, its threads cells). Much
shorter intervals pay for the switches themselves.

The interval is the process's: only a batcher that asks for a shorter one than the current sets it, and the last
of those to close restores the value found before the first, unless someone else changed it meanwhile. Pure-Python
CPU-bound threads of the process then switch more often (CPython's cost per switch is a few microseconds).
"""

from __future__ import annotations

import logging
import sys
import threading

__all__ = ["hold", "release"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0  # batchers open that set the interval
_found: float | None = None  # the interval before the first of them set it
_set: float | None = None  # the interval they set


def hold(seconds: float | None) -> bool:
    """Make the switch interval at most ``seconds`` while the caller runs; False (nothing to give back) when
    ``seconds`` is None or the interval is already that short. A True must be matched by one ``release``."""
    global _holders, _found, _set
    if seconds is None:
        return False
    with _lock:
        current = sys.getswitchinterval()
        if _holders == 0:
            if current <= seconds:
                return False
            _found, _set = current, seconds
            sys.setswitchinterval(seconds)
            log.info("the interpreter's GIL switch interval is %.1f ms while batchers run (it was %.1f ms): their "
                     "threads wait less behind threads running Python; switch_interval=None leaves it",
                     seconds * 1e3, current * 1e3)
        elif seconds < current:
            _set = seconds
            sys.setswitchinterval(seconds)
        _holders += 1
        return True


def release() -> None:
    """One ``hold`` that returned True is over: the last one restores the interval found before the first."""
    global _holders, _found, _set
    with _lock:
        _holders -= 1
        if _holders == 0:
            if _found is not None and _set is not None and abs(sys.getswitchinterval() - _set) < 1e-9:
                sys.setswitchinterval(_found)
            _found = _set = None
