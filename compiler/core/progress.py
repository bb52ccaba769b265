"""Progress that both terminals and CI logs show: one helper for stages, one for loops.

On a terminal a loop gets a rich progress bar (transient) and stages stay quiet; anywhere else
(a CI log, a file, a pipe) each stage logs one line with its elapsed time when it ends, and a
loop logs a line about every ``INTERVAL_S`` seconds plus one when it ends. Everything goes
through ``logging`` at INFO, so ``--quiet`` silences it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

__all__ = ["stage_timer", "progress", "INTERVAL_S", "is_terminal"]

log = logging.getLogger(__name__)

INTERVAL_S = 10.0  # seconds between progress lines in a log


def is_terminal() -> bool:
    """Whether stderr (where the log and the bar go) is a terminal."""
    from rich.console import Console

    return bool(Console(stderr=True).is_terminal)


@contextlib.contextmanager
def stage_timer(name: str) -> Iterator[None]:
    """Log ``name: 3.2 s`` when the block ends (``name: failed after 3.2 s`` when it raises).

    The line is INFO where stderr is not a terminal and DEBUG on a terminal, where the summary
    tables say the same.
    """
    start = time.perf_counter()
    level = logging.DEBUG if is_terminal() else logging.INFO
    try:
        yield
    except BaseException:
        log.log(level, "%s: failed after %.1f s", name, time.perf_counter() - start)
        raise
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
