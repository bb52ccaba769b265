"""Run a stage in a child process, so that a native crash becomes a one-line error naming the stage.

ONNX Runtime, like any native library, can crash the process that calls it (SIGSEGV in a kernel, the
kernel's OOM killer): Python gets no exception and nothing would be said. ``in_worker`` runs a function
in a fresh (spawned) interpreter, forwards its log records to this process's loggers, returns its result
or re-raises its exception, and turns a death by signal into ``WorkerCrashed`` with the stage and the
model part the worker was at, as it last reported with ``mark`` and ``mark_step`` (no-ops outside a
worker). Set ``TRTC_IN_PROCESS=1`` to run everything in the calling process instead (under a debugger).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from compiler.core.errors import WorkerCrashed

__all__ = ["in_worker", "isolated", "mark", "mark_step"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_LOGGERS = ("compiler", "calibration", "trtc")
_crumb: Path | None = None  # in a worker: where the current stage is written
_stage = ""


def isolated() -> bool:
    """Whether stages should run in workers here: yes unless TRTC_IN_PROCESS=1, and never inside a worker."""
    return os.environ.get("TRTC_IN_PROCESS", "") != "1" and _crumb is None


def mark(stage: str) -> None:
    """Record the stage a worker is entering (e.g. "FP16 accuracy gate: candidate with 2 layers kept in FP32")."""
    global _stage
    _stage = stage
    _write(stage)


def mark_step(step: str) -> None:
    """Record a step of the current stage (e.g. "batch 3"), replacing the previous step."""
    _write(f"{_stage}, {step}" if _stage else step)


def _write(text: str) -> None:
    if _crumb is not None:
        _crumb.write_text(text)


def in_worker(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a spawned child process; ``what`` names the work in a crash message.

    ``fn`` and its arguments must be picklable (a module-level function, dataclasses, paths). The
    result comes back pickled. Raises what ``fn`` raised (a bug's traceback from the child is added as a
    note), or ``WorkerCrashed`` when the child dies without an answer.
    """
    ctx = multiprocessing.get_context("spawn")
    levels = {name: logging.getLogger(name).getEffectiveLevel() for name in _LOGGERS}
    with tempfile.TemporaryDirectory(prefix="trtc-worker-") as scratch:
        crumb = Path(scratch) / "stage"
        records: Any = ctx.Queue()
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(send, records, levels, str(crumb), fn, args, kwargs),
                            name=f"trtc {what}", daemon=True)
        forwarder = threading.Thread(target=_forward, args=(records,), daemon=True)
        forwarder.start()
        with _main_not_rerun():
            child.start()
        send.close()
        try:
            answer = receive.recv()
        except EOFError:
            answer = None
        finally:
            child.join()
            records.put(None)
            forwarder.join()
            records.close()
        stage = crumb.read_text() if crumb.is_file() else "starting"
    if answer is None:
        raise WorkerCrashed(_crash_message(what, stage, child.exitcode))
    kind, payload, child_traceback = answer
    if kind == "ok":
        return payload  # type: ignore[no-any-return]
    if not hasattr(payload, "exit_code"):  # a bug: keep where it happened
        payload.add_note(f"raised in the {what} worker process:\n{child_traceback}")
    raise payload


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Keep the spawned child from importing this process's __main__ again (multiprocessing does, and a
    script without an ``if __name__ == "__main__"`` guard, such as a wrapper around the CLI, would run twice);
    the worker needs only the module of the function it runs."""
    main = sys.modules.get("__main__")
    saved = {key: getattr(main, key) for key in ("__file__", "__spec__") if hasattr(main, key)}
    try:
        if main is not None:
            main.__spec__ = None
            if hasattr(main, "__file__"):
                del main.__file__
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def _crash_message(what: str, stage: str, code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        cause = ("killed (out of memory? lower --calib-batch or free memory)" if -code == signal.SIGKILL
                 else f"crashed in native code ({name}), most likely inside ONNX Runtime")
    else:
        cause = f"exited with code {code} without an answer"
    return (f"the {what} worker {cause} during {stage}; nothing was written. Keep the op type or node it was "
            "running in FP32 (--keep-fp32 NAME) or lower --calib-batch, and please report it")


def _child(send: Any, records: Any, levels: dict[str, int], crumb: str, fn: Callable[..., Any],
           args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    global _crumb
    _die_with_parent()
    _crumb = Path(crumb)
    handler = logging.handlers.QueueHandler(records)
    for name, level in levels.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
    try:
        result = fn(*args, **kwargs)
        send.send(("ok", result, ""))
    except BaseException as err:  # everything goes back to the parent, which re-raises it
        text = traceback.format_exc()
        try:
            pickle.dumps(err)
        except Exception:  # one that cannot be pickled comes back as its text
            err = RuntimeError(f"{type(err).__name__}: {err}")
        send.send(("error", err, text))
    finally:
        send.close()
        records.close()
        records.join_thread()


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when the process that started it dies (a SIGKILLed `trtc build` must not
    leave a worker writing into its staging folder). Elsewhere the worker notices only when it next reports."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _forward(records: Any) -> None:
    """Hand the worker's log records to this process's loggers (and so to the CLI's handlers, or caplog)."""
    while True:
        record = records.get()
        if record is None:
            return
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
