"""Run a stage in a child process, so that a native crash becomes a one-line error naming the stage.

ONNX Runtime, like any native library, can crash the process that calls it (SIGSEGV in a kernel, the
kernel's OOM killer): Python gets no exception and nothing would be said. ``in_worker`` runs a function
in a fresh (spawned) interpreter, forwards its log records to this process's loggers, returns its result
or re-raises its exception, and turns a death by signal into ``WorkerCrashed`` with the stage and the
model part the worker was at, as it last reported with ``mark``, ``mark_step`` and ``mark_aside`` (no-ops
outside a worker). Set ``TRTC_IN_PROCESS=1`` to run everything in the calling process instead (under a debugger).
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import mmap
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

__all__ = ["Worker", "in_worker", "isolated", "mark", "mark_aside", "mark_step"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_LOGGERS = ("compiler", "calibration", "trtc")
_crumb: _Crumb | None = None  # in a worker: where the current stage is written
_stage = ""
_step = ""
_aside = ""
_crumb_lock = threading.Lock()


def isolated() -> bool:
    """Whether stages should run in workers here: yes unless TRTC_IN_PROCESS=1, and never inside a worker."""
    return os.environ.get("TRTC_IN_PROCESS", "") != "1" and _crumb is None


def mark(stage: str) -> None:
    """Record the stage a worker is entering (e.g. "FP16 accuracy gate: candidate with 2 layers kept in FP32")."""
    global _stage, _step
    with _crumb_lock:
        _stage, _step = stage, ""
        _write()


def mark_step(step: str) -> None:
    """Record a step of the current stage (e.g. "batch 3"), replacing the previous step."""
    global _step
    with _crumb_lock:
        _step = step
        _write()


def mark_aside(note: str) -> None:
    """Record what a helper thread of the current stage is doing (e.g. "reading batch 4 ahead"), or clear it
    with ``""``: a crash there is then named beside the step the stage was at."""
    global _aside
    with _crumb_lock:
        _aside = note
        _write()


def _write() -> None:
    """Write the crumb's text, under ``_crumb_lock``."""
    if _crumb is None:
        return
    _crumb.write(", ".join(part for part in (_stage, _step) if part) + (f" (meanwhile {_aside})" if _aside else ""))


class _Crumb:
    """The worker's stage text in a memory-mapped file that the parent reads once the child is gone: two slots and
    a first byte naming the slot last written whole, so that a crash in another thread while one slot is written
    leaves the other. A write is a copy into memory, no system call: the sample scan marks two per sample (a file
    written and renamed each time cost 0.27 ms a mark, 0.28 s for 512 samples)."""

    SLOT = 2048  # bytes per slot: a length (2 bytes) and the text, cut to fit

    @classmethod
    def create(cls, path: Path) -> None:
        path.write_bytes(bytes(1 + 2 * cls.SLOT))

    def __init__(self, path: Path) -> None:
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 1 + 2 * self.SLOT)

    def write(self, text: str) -> None:
        data = text.encode("utf-8")[:self.SLOT - 2]
        slot = 1 - self._map[0]
        at = 1 + slot * self.SLOT
        self._map[at:at + 2 + len(data)] = len(data).to_bytes(2, "little") + data
        self._map[0] = slot

    @classmethod
    def read(cls, path: Path) -> str:
        """The text last written whole; "" when nothing was (or there is no such file)."""
        try:
            data = path.read_bytes()
        except OSError:
            return ""
        if len(data) != 1 + 2 * cls.SLOT:
            return ""
        at = 1 + (data[0] & 1) * cls.SLOT
        size = int.from_bytes(data[at:at + 2], "little")
        return data[at + 2:at + 2 + size].decode("utf-8", errors="ignore")


def in_worker(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a spawned child process; ``what`` names the work in a crash message.

    ``fn`` and its arguments must be picklable (a module-level function, dataclasses, paths). The
    result comes back pickled. Raises what ``fn`` raised (a bug's traceback from the child is added as a
    note), or ``WorkerCrashed`` when the child dies without an answer.
    """
    with Worker() as worker:
        return worker.run(what, fn, *args, **kwargs)


class Worker:
    """A spawned worker process for one call, started before the call is known: its interpreter start, its
    imports and ``warm`` (a picklable function, e.g. loading CUDA and ONNX Runtime's provider libraries) overlap
    what the caller does meanwhile, and ``run`` then hands it the call (as ``in_worker`` does), or ``start`` hands
    it over and ``result`` waits for it, the caller working on meanwhile. A ``warm`` that raises is logged (debug)
    and the worker goes on: warming is an optimisation. Closing a worker that has not answered ends it; use it as a
    context manager so that every path closes it.
    """

    def __init__(self, warm: Callable[[], Any] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        levels = {name: logging.getLogger(name).getEffectiveLevel() for name in _LOGGERS}
        self._scratch = tempfile.TemporaryDirectory(prefix="trtc-worker-")
        self._crumb = Path(self._scratch.name) / "stage"
        _Crumb.create(self._crumb)
        self._records: Any = ctx.Queue()
        self._receive, send = ctx.Pipe(duplex=False)
        calls, self._calls = ctx.Pipe(duplex=False)
        self._child = ctx.Process(target=_child, args=(calls, send, self._records, levels, str(self._crumb), warm),
                                  name="trtc worker", daemon=True)
        self._forwarder = threading.Thread(target=_forward, args=(self._records,), daemon=True)
        self._forwarder.start()
        with _main_not_rerun():
            self._child.start()
        send.close()
        calls.close()
        self._what: str | None = None  # the call's name, once started
        self._sent = self._answered = self._closed = False

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in this worker, once; what ``in_worker`` returns and raises."""
        self.start(what, fn, *args, **kwargs)
        return self.result()  # type: ignore[no-any-return]

    def start(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Hand the worker its one call and return at once; ``result`` waits for it. A worker closed before its
        answer came (the caller failed meanwhile) is terminated: the call's work is abandoned."""
        if self._closed or self._what is not None:
            raise RuntimeError("a Worker runs one call; start another for the next")
        self._what = what
        try:
            self._calls.send((fn, args, kwargs))
        except BrokenPipeError:  # the child died before the call: ``result`` says so
            self._sent = False
        else:
            self._sent = True

    def result(self) -> Any:
        """What the started call returned, or raise what it raised (``WorkerCrashed`` when the child died)."""
        if self._what is None or self._closed:
            raise RuntimeError("result() of a Worker needs a started call, once")
        answer = None
        if self._sent:
            try:
                answer = self._receive.recv()
            except EOFError:  # the child died during the call
                answer = None
        self._answered = answer is not None
        stage = _Crumb.read(self._crumb) or "starting"
        self.close()
        if answer is None:
            raise WorkerCrashed(_crash_message(self._what, stage, self._child.exitcode))
        kind, payload, child_traceback = answer
        if kind == "ok":
            return payload
        if not hasattr(payload, "exit_code"):  # a bug: keep where it happened
            payload.add_note(f"raised in the {self._what} worker process:\n{child_traceback}")
        raise payload

    def close(self) -> None:
        """End the worker and stop forwarding its log records: one that answered has exited; an unused one is
        terminated (it may still be warming, and an error on the way to its call should not wait for that), and
        so is one whose call is abandoned (closed before ``result``)."""
        if self._closed:
            return
        self._closed = True
        self._calls.close()
        if not self._answered:
            self._child.terminate()
        self._child.join()
        self._receive.close()
        self._records.put(None)
        self._forwarder.join()
        self._records.close()
        self._scratch.cleanup()


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


def _child(calls: Any, send: Any, records: Any, levels: dict[str, int], crumb: str,
           warm: Callable[[], Any] | None) -> None:
    global _crumb
    _die_with_parent()
    _crumb = _Crumb(Path(crumb))
    handler = logging.handlers.QueueHandler(records)
    for name, level in levels.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
    try:
        if warm is not None:
            try:
                warm()
            except Exception as err:  # warming is an optimisation: the call itself meets whatever failed here
                log.debug("warming the worker failed: %s", err)
        try:
            fn, args, kwargs = calls.recv()
        except EOFError:  # closed unused
            return
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
