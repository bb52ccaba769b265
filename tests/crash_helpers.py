"""Functions that crash the process calling them, for the crash-isolation tests (run in worker processes).

They raise SIGSEGV in the calling thread, as a crash in native code does: a signal sent to the process may be
taken by another thread while the caller goes on."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import numpy as np

from compiler.core.errors import CalibrationError
from compiler.core.worker import mark, mark_step

_passes = 0


def segfault_on_second_pass() -> Iterator[dict[str, np.ndarray]]:
    """A --calib-loader: the data check's pass goes through, the calibration pass dies of SIGSEGV after batch 0."""
    global _passes
    _passes += 1
    yield {"x": np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)}
    if _passes >= 2:
        signal.raise_signal(signal.SIGSEGV)


def segfault_at(stage: str, step: str) -> None:
    mark(stage)
    mark_step(step)
    signal.raise_signal(signal.SIGSEGV)


def square_and_log(x: int) -> int:
    logging.getLogger("calibration.test").warning("squaring %d in the worker", x)
    return x * x


def raise_user_error() -> None:
    raise CalibrationError("bad data: fix it")


def raise_bug() -> None:
    raise KeyError("internal")


_warmed: list[int] = []


def warm_and_log() -> None:
    """A worker's warm function: leaves its process id where ``warmed_pids`` reads it, and logs."""
    _warmed.append(os.getpid())
    logging.getLogger("calibration.test").warning("warming the worker")


def warmed_pids() -> tuple[list[int], int]:
    """The process ids the warm function recorded in this process, and this process's id."""
    return list(_warmed), os.getpid()


def warm_raises() -> None:
    raise RuntimeError("no GPU today")


def warm_segfaults() -> None:
    mark("warming")
    signal.raise_signal(signal.SIGSEGV)


def warm_forever() -> None:
    import time

    time.sleep(600)
