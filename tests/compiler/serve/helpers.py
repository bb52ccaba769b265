"""What the serving runtime's tests share: the eager reference, calls from many threads, small models."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compiler.serve import engines as runtime
from compiler.serve.engines import Engines
from compiler.serve.load import engines_from_module, load
from compiler.serve.processes import ClientHandle, ProcessBatcher
from examples import models
from tests.builds import BUCKETS, MODELS, build_directory


def eager(name: str, feed: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return MODELS[name][0]()(*[torch.from_numpy(v) for v in feed.values()]).numpy()

def call_from_threads(engines: Any, inputs: list[np.ndarray], got: list[Any], count: int, timeout: float) -> None:
    """``got[i] = engines(inputs[i])`` from ``count`` threads at once, each taking every count-th input."""

    def work(start: int) -> None:
        for i in range(start, len(inputs), count):
            got[i] = engines(inputs[i])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a call did not return: the context pool deadlocked"

def per_position() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

def conv_relu(bias: bool) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=bias), torch.nn.ReLU())

    return make

def one_context_on_cuda(backend: str, tmp_path: Path) -> runtime.Engines:
    if backend == "torch":
        return engines_from_module(models.mlp(), ["x:Bx64"], buckets=BUCKETS, device="cuda", contexts=1)
    return load(build_directory(tmp_path / "mlp", "mlp"), backend="onnxruntime", device="cuda", contexts=1)


class Recording:
    """The engines, with every batch recorded and (optionally) held at a gate until released."""

    def __init__(self, engines: Engines, gate: threading.Event | None = None) -> None:
        self.engines = engines
        self.gate = gate
        self.batches: list[np.ndarray] = []  # the first input of every batch
        self.feeds: list[dict[str, Any]] = []
        self.parts: list[int] = []  # the feeds each batch came in (start_parts)
        self.entered = threading.Event()
        self.buckets = engines.buckets
        self.input_names = engines.input_names
        self.output_names = engines.output_names
        self.spec = engines.spec

    def check(self, x: Any) -> Any:
        return self.engines.check(x)

    @property
    def queues_on_gpu(self) -> bool:
        return self.engines.queues_on_gpu

    def start_parts(self, calls: Any, wait: bool = True) -> Any:
        x = {name: np.concatenate([c.arrays[name] for c in calls]) for name in self.input_names}
        self.parts.append(len(calls))
        self._record(x)
        return self.engines.start_parts(calls, wait=wait)

    def __call__(self, x: Any) -> Any:
        x = dict(x)
        self._record(x)
        return self.engines(x)

    def _record(self, x: dict[str, Any]) -> None:
        self.feeds.append(x)
        self.batches.append(x[self.input_names[0]])
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=10), "the test never opened the gate"


def rows(i: int, n: int = 1) -> np.ndarray:
    """n rows that identify request i: value i everywhere."""
    return np.full((n, 64), float(i), np.float32)


def join_all(threads: list[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "requests still waiting: the batcher deadlocked"


def _client_process(handle: ClientHandle, requests: list[Any], results: Any) -> None:
    """In a spawned process: every request from its own thread, the answers sent back by index."""
    client = handle.connect()
    answers: dict[int, Any] = {}

    def one(i: int) -> None:
        answers[i] = client.submit(requests[i], timeout=20)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    results.put(answers)


def from_client_processes(batcher: ProcessBatcher, requests: list[list[Any]], timeout: float) -> list[dict[int, Any]]:
    """Each list of requests from a spawned client process of its own (a thread per request): their answers by index,
    one dict per process, in the order the processes finished."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    workers = [spawn.Process(target=_client_process, args=(batcher.client_handle(len(mine)), mine, results))
               for mine in requests]
    for worker in workers:
        worker.start()
    answers = [results.get(timeout=timeout) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    return answers



class Slow(Recording):
    """Batches wait at a gate; the first batch optionally fails."""

    def __init__(self, engines: Engines, hold: threading.Event, fail: bool = False) -> None:
        super().__init__(engines)
        self.hold, self.fail = hold, fail

    def __call__(self, x: Any) -> Any:
        """The process batcher's probe of the output sizes: not a batch, so it leaves ``entered`` unset (tests wait
        on it for a batch that is running)."""
        return self.engines(x)

    def start_parts(self, calls: Any, wait: bool = True) -> Any:
        self.entered.set()
        assert self.hold.wait(timeout=10)
        if self.fail:
            raise RuntimeError("CUDA out of memory (injected)")
        return self.engines.start_parts(calls, wait=wait)


class FirstPositives:
    """A model whose output size depends on its data: the first n columns, n = positives in the first row."""

    def __new__(cls) -> Any:
        import torch

        class Module(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x[:, :int((x[0] > 0).sum())] * 2

        return Module()
