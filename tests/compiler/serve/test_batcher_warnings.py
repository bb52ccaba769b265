"""What ``DynamicBatcher`` says once, at start or on the way, about a configuration that costs throughput, and that
it serves every request all the same."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from compiler.serve.batcher import DynamicBatcher
from compiler.serve.engines import Engines
from tests.compiler.serve.helpers import Recording, rows


def test_a_batcher_on_engines_that_launch_every_kernel_on_its_thread_says_so_once_at_start(
        engines: Engines, caplog: pytest.LogCaptureFixture) -> None:
    """GPU engines whose ``start_parts`` launches every kernel on the caller's thread holding the GIL (eager torch
    without CUDA graphs: ``launches_on_host`` and not ``starts_at_once``) cannot serve this process's threads at the
    targets; the batcher says so once, at start, naming the faster paths, and not for engines that queue their work
    (CUDA graphs, ONNX Runtime's launcher) or the CPU."""
    class Eager(Recording):
        queues_on_gpu = True  # type: ignore[assignment]  # CPU engines, driven as a GPU's would be
        launches_on_host = True
        starts_at_once = False

    class Graphs(Eager):
        launches_on_host = False
        starts_at_once = True

    for kind, told in ((Eager, 1), (Graphs, 0), (Recording, 0)):
        caplog.clear()
        with (caplog.at_level("WARNING", logger="compiler.serve.batcher"),
              DynamicBatcher(kind(engines), max_wait_ms=1) as batcher):  # type: ignore[arg-type]
            batcher.submit(rows(1), timeout=10)
            batcher.submit(rows(2), timeout=10)
        said = [r.getMessage() for r in caplog.records if "holding the GIL" in r.getMessage()]
        assert len(said) == told, (kind.__name__, said)
        assert all("cuda_graphs=True" in m and "ProcessBatcher" in m for m in said)


def test_several_workers_on_engines_of_one_bucket_are_told_once_to_use_one(
        engines: Engines, caplog: pytest.LogCaptureFixture) -> None:
    """Engines that run every batch padded to their one bucket (ONNX Runtime's CUDA graphs at the largest bucket
    only) lose throughput to a second worker, which splits requests into smaller batches that cost a full one: the
    batcher says so once at start, naming workers=1, and says nothing with one worker or with several buckets; the
    requests are answered all the same."""
    class OneBucket(Recording):
        def __init__(self, inner: Engines) -> None:
            super().__init__(inner)
            self.buckets = (inner.buckets[-1],)

    for kind, workers, told in ((OneBucket, 2, 1), (OneBucket, 1, 0), (Recording, 2, 0)):
        caplog.clear()
        with (caplog.at_level("WARNING", logger="compiler.serve.batching"),
              DynamicBatcher(kind(engines), max_wait_ms=1, workers=workers) as batcher):  # type: ignore[arg-type]
            np.testing.assert_allclose(batcher.submit(rows(3), timeout=10), engines(rows(3)), rtol=1e-6)
        said = [r.getMessage() for r in caplog.records if "padded" in r.getMessage()]
        assert len(said) == told, (kind.__name__, workers, said)
        assert all("workers=1" in m and f"at {engines.buckets[-1]} rows" in m for m in said)


def test_many_threads_blocking_in_submit_are_told_once_of_the_faster_paths(
        engines: Engines, caplog: pytest.LogCaptureFixture) -> None:
    """Proves: as many threads as half the batch (8 at least) blocking in ``submit`` get one warning naming
    ProcessBatcher and ``await infer``, however many more requests they send; fewer threads get none; every
    request of both is answered with its own rows."""
    limit = max(8, engines.buckets[-1] // 2)
    for threads, told in ((limit - 1, 0), (limit + 2, 1)):
        caplog.clear()
        errors: list[BaseException] = []
        start = threading.Barrier(threads)
        with (caplog.at_level("WARNING", logger="compiler.serve.batching"),
              DynamicBatcher(engines, max_wait_ms=1) as batcher):
            def client(i: int, start: threading.Barrier, errors: list[BaseException]) -> None:
                try:
                    start.wait()
                    for _ in range(3):
                        np.testing.assert_allclose(batcher.submit(rows(i), timeout=10),
                                                   engines(rows(i)), rtol=1e-6)
                except BaseException as err:  # reported below
                    errors.append(err)

            pool = [threading.Thread(target=client, args=(i, start, errors)) for i in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        assert not errors, errors
        said = [r.getMessage() for r in caplog.records if "threads block in submit" in r.getMessage()]
        assert len(said) == told, (threads, said)
        assert all("ProcessBatcher" in m and "awaiting infer" in m for m in said)
