"""Progress that both terminals and CI logs show: one helper for stages, one for loops.

On a terminal a loop gets a rich progress bar (transient) and stages stay quiet; anywhere else
(a CI log, a file, a pipe) each stage logs one line with its elapsed time when it ends, and a
loop logs a line about every ``INTERVAL_S`` seconds plus one when it ends. Everything goes
through ``logging`` at INFO, so ``--quiet`` silences it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["stage_timer", "progress", "INTERVAL_S", "is_terminal", "StageTimes", "recording_stages",
           "process_seconds"]

log = logging.getLogger(__name__)

INTERVAL_S = 10.0  # seconds between progress lines in a log


def is_terminal() -> bool:
    """Whether stderr (where the log and the bar go) is a terminal."""
    from rich.console import Console

    return bool(Console(stderr=True).is_terminal)


_START = time.perf_counter()  # where /proc cannot say when the process started: this module's import


def process_seconds() -> float:
    """Seconds since this process started (interpreter start and imports included): from Linux's /proc, else since
    this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _START


@dataclass
class StageTimes:
    """The stages of one command, in the order they first ran, with their seconds (a stage that runs twice adds up);
    stages inside another stage count in the outer one only. ``record`` adds a time measured elsewhere."""

    stages: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)  # when recording began
    before: float = 0.0  # process seconds before recording began (interpreter start, imports, options)

    def record(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def to_dict(self) -> dict[str, Any]:
        """``{"stages": {name: s}, "process_seconds": s, "unaccounted_seconds": s}``: the process's seconds so far
        and the part of them no stage holds, rounded to 10 ms."""
        total = self.before + time.perf_counter() - self.started
        stages = {name: round(seconds, 2) for name, seconds in self.stages.items()}
        return {"stages": stages, "process_seconds": round(total, 2),
                "unaccounted_seconds": round(total - sum(self.stages.values()), 2)}


_RECORDING: list[StageTimes] = []  # the record of the command running now, if any
_DEPTH = [0]


@contextlib.contextmanager
def recording_stages(before: str | None = None) -> Iterator[StageTimes]:
    """Record every outermost ``stage_timer`` of the block. With ``before``, the process's seconds until now
    (``process_seconds``: interpreter start, imports, reading the options) are its first stage, so named; without,
    inside another record, that record (a library call inside a command's record adds to it)."""
    if _RECORDING and before is None:  # inside a command's record: the same record
        yield _RECORDING[-1]
        return
    times = StageTimes()
    if before is not None:
        times.before = process_seconds()
        times.record(before, times.before)
    _RECORDING.append(times)
    try:
        yield times
    finally:
        _RECORDING.remove(times)


@contextlib.contextmanager
def stage_timer(name: str) -> Iterator[None]:
    """Log ``name: 3.2 s`` when the block ends (``name: failed after 3.2 s`` when it raises).

    The line is INFO where stderr is not a terminal and DEBUG on a terminal, where the summary
    tables say the same. Inside ``recording_stages``, an outermost stage is recorded too.
    """
    start = time.perf_counter()
    level = logging.DEBUG if is_terminal() else logging.INFO
    _DEPTH[0] += 1
    try:
        yield
    except BaseException:
        log.log(level, "%s: failed after %.1f s", name, time.perf_counter() - start)
        raise
    finally:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0 and _RECORDING:
            _RECORDING[-1].record(name, time.perf_counter() - start)
    log.log(level, "%s: %.1f s", name, time.perf_counter() - start)


@contextlib.contextmanager
def progress(what: str, total: int, unit: str = "samples") -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)`` for a loop over ``total`` items (samples, layers).

    On a terminal: a rich bar on stderr. Elsewhere: ``what: 48/128 samples (38%), 12 s`` about every
    ``INTERVAL_S`` seconds and ``what: 128/128 samples in 30.1 s`` at the end. Nothing when INFO is off.
    """
    if not log.isEnabledFor(logging.INFO):
        yield lambda n: None
        return
    if is_terminal():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(what, total=total)
            yield lambda n: bar.advance(task, n)
        return
    start = last = time.perf_counter()
    done = 0

    def advance(n: int) -> None:
        nonlocal done, last
        done += n
        now = time.perf_counter()
        if now - last >= INTERVAL_S and done < total:
            last = now
            log.info("%s: %d/%d %s (%.0f%%), %.0f s", what, done, total, unit, 100.0 * done / max(total, 1),
                     now - start)

    yield advance
    log.info("%s: %d/%d %s in %.1f s", what, done, total, unit, time.perf_counter() - start)
