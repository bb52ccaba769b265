"""The load checks a precision file passes before it is written: ONNX Runtime loads and runs it, through the
one session policy (``ort_session``), on every provider the checks and serving use here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import onnx

from compiler.core.capabilities import checking_providers
from compiler.core.errors import CalibrationError, first_line
from compiler.core.onnx_io import ort_session
from compiler.core.worker import mark

log = logging.getLogger(__name__)


def check_serving_load(path: Path, feed: dict[str, Any], proven: set[str]) -> None:
    """Load ``path`` as ``compiler.load`` and ``trtc bench`` do (``ort_session``: the one session policy) on every
    provider the checks and serving use here, and run ``feed`` (one sample): a file ONNX Runtime would refuse is
    never written. ``proven``: the providers on which this very graph has just been loaded and run through
    ``ort_session`` (the accuracy gate's, where it did not emulate FP16; ``LoadCheckBeside``'s): it is not loaded
    there again (on an H200 the two loads of a ViT-B/16's INT8 file took 3.3 s). Raises ``CalibrationError``
    naming the provider and ONNX Runtime's first line."""
    providers = list(dict.fromkeys([checking_providers()[0], "CPUExecutionProvider"]))
    for chosen in providers:
        if chosen in proven:
            log.debug("%s: already loaded and run on %s", path.name, chosen)
            continue
        mark(f"{path.name}: load check on {chosen}")
        _load_and_run(path, chosen, feed, path.name)
    log.debug("%s loads and runs on %s", path.name, ", ".join(providers))


def _load_and_run(model: Path | onnx.ModelProto, provider: str, feed: dict[str, Any], name: str) -> None:
    """One ``ort_session`` of ``model`` (a file or a proto) on ``provider`` (the CPU behind it) and one call of
    ``feed``; ``name``: the precision file's name, for the message."""
    try:
        session = ort_session(model, list(dict.fromkeys([provider, "CPUExecutionProvider"])))
        session.run(None, feed)
    except Exception as err:  # onnxruntime's pybind errors share no narrower base class
        raise CalibrationError(f"{name}: ONNX Runtime's {provider} does not run it as trtc serves it "
                               f"({first_line(err)}); nothing was written: keep the node it names in FP32 "
                               "(--keep-fp32 NODE), and please report it") from err
    del session


class LoadCheckBeside:
    """The CPU provider's load check of the gate's first candidate, in a thread while the gate runs that
    candidate on CUDA: most builds keep it (no layer falls back), and its session on the CPU (graph optimization,
    one run) then costs no time of its own (about 2 s on an H200 host for a ViT-B/16's INT8 file). Where the
    gate itself runs on the CPU it loads the candidate there anyway, so nothing starts. ``feed`` gives the one
    sample every load check runs; ``name``: the precision file's name, for the message."""

    def __init__(self, feed: Callable[[], dict[str, Any]], name: str) -> None:
        self._make_feed, self._name = feed, name
        self._feed: dict[str, Any] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trtc-load-check")
        self._candidate: onnx.ModelProto | None = None
        self._future: Future[None] | None = None

    def feed(self) -> dict[str, Any]:
        if self._feed is None:
            self._feed = self._make_feed()
        return self._feed

    def start(self, candidate: onnx.ModelProto) -> None:
        """Check ``candidate`` on the CPU provider from now on, where the gate runs on another one."""
        if checking_providers()[0] == "CPUExecutionProvider":
            return
        feed = self.feed()
        self._candidate = candidate
        self._future = self._pool.submit(self._check, candidate, feed)

    def _check(self, candidate: onnx.ModelProto, feed: dict[str, Any]) -> None:
        # the gate reads the same proto meanwhile: both only read it (ort_session and save_onnx leave it as it was)
        _load_and_run(candidate, "CPUExecutionProvider", feed, self._name)

    def proven(self, final: onnx.ModelProto) -> set[str]:
        """The providers on which ``final`` has loaded and run here: the CPU when it is the candidate checked.
        Raises that check's ``CalibrationError`` when ``final`` is the candidate and failed it."""
        if self._future is None or final is not self._candidate:
            return set()
        self._future.result()
        return {"CPUExecutionProvider"}

    def __enter__(self) -> LoadCheckBeside:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)  # a failed gate still waits for the check's session to be dropped
