"""One buffer set of an ``Engines`` as a ``Runner`` (``Engines.runner``): the serving path, stage by stage, as
``trtc bench`` times it."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from compiler.backends.base import Context, Runner
from compiler.backends.feeds import CheckedFeed
from compiler.core.errors import FeedError

__all__ = ["ContextRunner", "BatchTooLarge"]


class _Pool(Protocol):
    """What the runner needs of ``compiler.serve.engines.Engines``."""

    buckets: tuple[int, ...]
    input_names: list[str]
    output_names: list[str]

    @property
    def device(self) -> str: ...

    def borrow(self) -> contextlib.AbstractContextManager[Context]: ...

    def check(self, x: Any) -> CheckedFeed: ...

    def bucket_for(self, rows: int) -> int: ...

    def close(self) -> None: ...


class BatchTooLarge(FeedError):
    """A runner over one buffer set runs at most the largest bucket's rows (``Engines`` itself runs more in
    chunks)."""


class ContextRunner(Runner):
    """A ``Runner`` over one buffer set of an ``Engines`` (``Engines.runner``): ``upload`` checks the feed as
    ``engines(x)`` does and queues its copy into the bucket's buffers, ``execute`` queues the model run,
    ``download`` queues the outputs' copy to pinned host memory, waits, and returns copies of them. The set is
    borrowed (``Engines.borrow``) from ``activate`` to ``release``; batches up to the largest bucket only."""

    def __init__(self, engines: _Pool, name: str, closing: bool = False) -> None:
        super().__init__()
        self.engines = engines
        self.name = name
        self.closing = closing
        self.device = "cuda" if str(engines.device).startswith("cuda") else "cpu"
        self.input_names = list(engines.input_names)
        self.output_names = list(engines.output_names)
        self._borrowed: contextlib.ExitStack | None = None
        self._context: Context | None = None
        self._call: CheckedFeed | None = None
        self._bucket = 0

    def _activate(self) -> None:
        self._borrowed = contextlib.ExitStack()
        self._context = self._borrowed.enter_context(self.engines.borrow())
        self.stream = self._context.stream

    def check(self, feed: Mapping[str, np.ndarray]) -> CheckedFeed:
        """``engines.check``: every input against the spec; at most the largest bucket's rows."""
        call = self.engines.check(dict(feed))
        if call.rows > self.engines.buckets[-1]:
            raise BatchTooLarge(f"batch {call.rows} is larger than the largest bucket {self.engines.buckets[-1]}")
        return call

    def _upload(self, call: CheckedFeed) -> None:
        assert self._context is not None
        self._call, self._bucket = call, self.engines.bucket_for(call.rows)
        self._context.upload(self._bucket, call, 0, call.rows)

    def _execute(self) -> None:
        assert self._context is not None and self._call is not None
        self._context.compute(self._bucket, self._call)

    def _download(self) -> dict[str, np.ndarray]:
        assert self._context is not None
        self._context.download(True)
        self._context.wait()
        return self._context.copy_outputs()

    def _release(self) -> None:
        if self._borrowed is not None:
            self._borrowed.close()
        self._borrowed = self._context = self._call = None
        if self.closing:
            self.engines.close()
