"""The dynamic batcher on ONNX Runtime (CPU): packing, one answer per request, timeouts, the priority lane."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compiler.core.errors import FeedError, InputError
from compiler.serve.batcher import DynamicBatcher
from compiler.serve.engines import Engines
from compiler.serve.load import load
from compiler.serve.waits import BatcherClosed, OverdueWaits, RequestTimeout
from tests.builds import build_directory
from tests.compiler.serve.helpers import (
    Recording,
    join_all,
    rows,
)


def test_200_concurrent_requests_each_get_their_own_rows(engines: Engines) -> None:
    recording = Recording(engines)
    rng = np.random.default_rng(0)
    requests = [rng.standard_normal((int(rng.integers(1, 4)), 64)).astype(np.float32) for _ in range(200)]
    want = [engines(x) for x in requests]
    answers: dict[int, list[Any]] = {i: [] for i in range(200)}
    errors: list[BaseException] = []

    def client(first: int) -> None:
        for i in range(first, 200, 20):
            try:
                answers[i].append(batcher.submit(requests[i], timeout=20))
            except BaseException as err:
                errors.append(err)

    with DynamicBatcher(recording, max_wait_ms=5) as batcher:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(20)]
        start = time.monotonic()
        for t in threads:
            t.start()
        join_all(threads, timeout=30)
        elapsed = time.monotonic() - start
    assert not errors
    for i in range(200):
        assert len(answers[i]) == 1, f"request {i} answered {len(answers[i])} times"
        np.testing.assert_allclose(answers[i][0], want[i], rtol=1e-5, atol=1e-6)
    assert sum(len(b) for b in recording.batches) == sum(len(x) for x in requests)
    assert len(recording.batches) < 200, "no request was packed with another"
    assert max(len(b) for b in recording.batches) <= max(engines.buckets)
    assert elapsed < 30


def test_future_api_and_dict_requests(engines: Engines) -> None:
    with DynamicBatcher(engines, max_wait_ms=1) as batcher:
        futures = [batcher.submit_async(rows(i, 2)) for i in range(5)]
        named = batcher.submit_async({"x": rows(9)})
        for i, future in enumerate(futures):
            np.testing.assert_allclose(future.result(timeout=10), engines(rows(i, 2)), rtol=1e-5, atol=1e-6)
        assert list(named.result(timeout=10)) == ["out"]
        with pytest.raises(FeedError, match="dtype float64"):
            batcher.submit(np.zeros((1, 64)))
    with pytest.raises(BatcherClosed):
        batcher.submit(rows(0))


def test_a_request_queued_past_its_timeout_fails_clearly(engines: Engines) -> None:
    gate = threading.Event()
    recording = Recording(engines, gate)
    batcher = DynamicBatcher(recording, max_wait_ms=0, max_batch=1)
    try:
        first = batcher.submit_async(rows(0))
        assert recording.entered.wait(timeout=10)  # the worker is now busy with request 0
        start = time.monotonic()
        with pytest.raises(RequestTimeout, match="no answer within 50 ms"):
            batcher.submit(rows(1), timeout=0.05)
        assert time.monotonic() - start < 2
        waiting = batcher.submit_async(rows(2), timeout=0.05)
        time.sleep(0.1)
        gate.set()
        with pytest.raises(RequestTimeout, match=r"waited \d+ ms in the queue, over its timeout of 50 ms"):
            waiting.result(timeout=10)
        np.testing.assert_allclose(first.result(timeout=10), engines(rows(0)), rtol=1e-5, atol=1e-6)
        assert [float(b[0, 0]) for b in recording.batches] == [0.0], "timed-out requests must not run"
    finally:
        gate.set()
        batcher.close()


def test_high_priority_requests_go_first(engines: Engines) -> None:
    gate = threading.Event()
    recording = Recording(engines, gate)
    batcher = DynamicBatcher(recording, max_wait_ms=0, max_batch=4)
    try:
        futures = [batcher.submit_async(rows(0))]
        assert recording.entered.wait(timeout=10)
        futures += [batcher.submit_async(rows(i)) for i in range(1, 7)]
        futures.append(batcher.submit_async(rows(100), priority=True))
        gate.set()
        for future in futures:
            future.result(timeout=10)
    finally:
        gate.set()
        batcher.close()
    order = [[int(v) for v in b[:, 0]] for b in recording.batches]
    assert order == [[0], [100, 1, 2, 3], [4, 5, 6]]


def test_a_worker_whose_window_was_taken_by_another_keeps_serving(engines: Engines) -> None:
    """Two workers: one waits out the window of request 0, the other takes 0 and 1 as a full batch meanwhile. The
    first must look at the queue again when its window ends, not take a batch from the emptied queue: that raised
    an IndexError in the worker's thread, which then died (every 2-context run of the serving benchmark has two
    workers). Both workers are alive afterwards and later requests are answered."""
    gate = threading.Event()
    recording = Recording(engines, gate)
    batcher = DynamicBatcher(recording, max_wait_ms=150, max_batch=2, workers=2)  # type: ignore[arg-type]
    try:
        first = [batcher.submit_async(rows(0))]
        time.sleep(0.02)  # a worker waits for request 0's window
        first.append(batcher.submit_async(rows(1)))  # full: the other worker takes both
        assert recording.entered.wait(timeout=10)
        time.sleep(0.3)  # the first worker's window is over
        assert all(thread.is_alive() for thread in batcher._threads), "a worker died"
        gate.set()
        later = [batcher.submit_async(rows(i)) for i in range(2, 6)]
        for i, future in enumerate(first + later):
            np.testing.assert_allclose(future.result(timeout=10), engines(rows(i)), rtol=1e-6)
    finally:
        gate.set()
        batcher.close()


def test_requests_of_other_shapes_are_not_packed_together(tmp_path: Path) -> None:
    directory = build_directory(tmp_path / "tr", "transformer_encoder")
    with load(directory, backend="onnxruntime") as engines:
        recording = Recording(engines)
        feeds = [{"input_ids": np.full((1, n), i, np.int64), "attention_mask": np.ones((1, n), np.int64)}
                 for i, n in enumerate((4, 4, 9, 4, 9))]
        with DynamicBatcher(recording, max_wait_ms=50) as batcher:
            futures = [batcher.submit_async(f) for f in feeds]
            results = [f.result(timeout=10) for f in futures]
        for feed, result in zip(feeds, results):
            np.testing.assert_allclose(result["out"], engines(feed)["out"], rtol=1e-5, atol=1e-5)
        assert sorted(tuple(b[:, 0]) for b in recording.batches) == [(0, 1, 3), (2, 4)]


def test_a_batch_takes_requests_of_its_shape_from_past_the_first_max_batch_requests(tmp_path: Path) -> None:
    """The batcher gives the policy the queue's first ``max_batch`` requests, and the whole queue when their batch is
    not full: a request of the first one's shape further back still joins it."""
    directory = build_directory(tmp_path / "tr", "transformer_encoder")
    with load(directory, backend="onnxruntime") as engines:
        gate = threading.Event()
        recording = Recording(engines, gate)
        feeds = [{"input_ids": np.full((1, n), i, np.int64), "attention_mask": np.ones((1, n), np.int64)}
                 for i, n in enumerate((9, 4, 9, 9, 4))]
        with DynamicBatcher(recording, max_wait_ms=0, max_batch=2) as batcher:
            try:
                futures = [batcher.submit_async(feeds[0])]
                assert recording.entered.wait(timeout=10)  # its batch is held at the gate while the others queue
                futures += [batcher.submit_async(f) for f in feeds[1:]]
            finally:
                gate.set()
            results = [f.result(timeout=10) for f in futures]
        for feed, result in zip(feeds, results):
            np.testing.assert_allclose(result["out"], engines(feed)["out"], rtol=1e-5, atol=1e-5)
        assert [b[:, 0].tolist() for b in recording.batches] == [[0], [1, 4], [2, 3]]


def test_close_without_draining_fails_queued_requests(engines: Engines) -> None:
    gate = threading.Event()
    recording = Recording(engines, gate)
    batcher = DynamicBatcher(recording, max_wait_ms=0, max_batch=1)
    running = batcher.submit_async(rows(0))
    assert recording.entered.wait(timeout=10)
    queued = batcher.submit_async(rows(1))
    closer = threading.Thread(target=batcher.close, kwargs={"drain": False})
    closer.start()
    time.sleep(0.05)
    gate.set()
    join_all([closer], timeout=10)
    running.result(timeout=10)
    with pytest.raises(BatcherClosed):
        queued.result(timeout=10)


def test_bad_settings() -> None:
    class Fake:
        buckets = (1, 4)

    with pytest.raises(InputError, match="max_batch=0"):
        DynamicBatcher(Fake(), max_batch=0)  # type: ignore[arg-type]


def test_requests_go_straight_into_the_contexts_buffers(engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """No batch array of the batcher's own: 5 requests (6 rows) are 5 row-copies into the context's input buffer
    (``upload_parts``), never a concatenation first; answers stay right."""
    from compiler.backends.host import HostContext

    uploads: list[list[int]] = []
    upload_parts = HostContext.upload_parts

    def recording(self: Any, bucket: int, calls: Any) -> None:
        uploads.append([c.rows for c in calls])
        upload_parts(self, bucket, calls)

    def no_concatenate(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the batcher packed a batch array")

    monkeypatch.setattr(HostContext, "upload_parts", recording)
    monkeypatch.setattr(np, "concatenate", no_concatenate)
    with DynamicBatcher(engines, max_batch=5, max_wait_ms=2000, workers=1) as batcher:
        futures = [batcher.submit_async(rows(i, 1 + i % 2)) for i in range(3)] + [
            batcher.submit_async(rows(i)) for i in range(3, 5)]
        results = [f.result(timeout=10) for f in futures]
    monkeypatch.undo()
    assert uploads and sum(len(u) for u in uploads) == 5 and sum(map(sum, uploads)) == 6
    for i, out in enumerate(results):
        np.testing.assert_allclose(out, engines(rows(i, len(out))), rtol=1e-6)


def test_asyncio_requests_are_answered_in_one_loop_call_per_batch(engines: Engines) -> None:
    """``await batcher.infer(x)`` from 64 coroutines: each gets its own rows; a batch's answers reach the loop
    in one call_soon_threadsafe; a queue timeout and a caller's cancellation behave as in ``submit``."""
    import asyncio

    calls: list[int] = []

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        with DynamicBatcher(engines, max_batch=16, max_wait_ms=50, workers=2) as batcher:
            return await asyncio.gather(*(batcher.infer(rows(i)) for i in range(64)))

    results = asyncio.run(main())
    for i, out in enumerate(results):
        np.testing.assert_allclose(out, engines(rows(i)), rtol=1e-6)
    assert 4 <= len(calls) <= 8  # one per batch of 16 (one per request would be 64)

    async def timed_out() -> None:
        gate = threading.Event()
        with DynamicBatcher(Recording(engines, gate), max_batch=1, max_wait_ms=0,  # type: ignore[arg-type]
                            workers=1) as batcher:
            first = asyncio.ensure_future(batcher.infer(rows(0)))
            await asyncio.sleep(0.05)
            start = time.monotonic()
            with pytest.raises(RequestTimeout, match="no answer within 50 ms"):  # the worker is held: the loop
                await batcher.infer(rows(1), timeout=0.05)  # fails it (one look every 10 ms, no timer per request)
            assert time.monotonic() - start < 1.0
            gate.set()
            np.testing.assert_allclose(await first, engines(rows(0)), rtol=1e-6)

    asyncio.run(timed_out())


def test_late_infer_requests_fail_after_a_loop_restart_and_a_closed_loop_is_not_kept(engines: Engines) -> None:
    """The loop's look for late requests survives the loop stopping and running again; a loop closed with requests
    still waiting (``run_until_complete``, not ``asyncio.run``, which cancels them) is freed once they are answered."""
    gate = threading.Event()
    recording = Recording(engines, gate)
    with DynamicBatcher(recording, max_batch=1, max_wait_ms=0, workers=1) as batcher:  # type: ignore[arg-type]
        loop = asyncio.new_event_loop()
        held = loop.create_task(batcher.infer(rows(0), timeout=30))  # the worker waits at the gate with it
        late = loop.create_task(batcher.infer(rows(1), timeout=0.05))
        loop.run_until_complete(asyncio.sleep(0.01))  # the loop stops with both waiting, then runs again
        start = time.monotonic()
        with pytest.raises(RequestTimeout, match="no answer within 50 ms"):
            loop.run_until_complete(late)
        assert time.monotonic() - start < 1.0
        waiting = [loop.create_task(batcher.infer(rows(i), timeout=30)) for i in (2, 3)]
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()  # with held and waiting still pending
        closed = weakref.ref(loop)
        del loop, held, late, waiting
        gate.set()
        deadline = time.monotonic() + 10
        while len(recording.batches) < 3 and time.monotonic() < deadline:  # 0, 2, 3 (1 was dropped, late)
            time.sleep(0.01)
        time.sleep(0.1)  # the last answer is handed to the closed loop (and dropped)
    gc.collect()
    assert closed() is None, "the batcher keeps a closed event loop and its waiting requests alive"


def test_overdue_waits_fail_each_wait_at_its_own_time_and_only_once() -> None:
    """Of two waits with one timeout, the one added later but due first fails first (a process batcher client's
    wait counts from its call, before it waited for a free slot); an answered (dropped) wait never fails and is not
    kept; a future already settled keeps its answer, and the look raises nothing."""
    loop = asyncio.new_event_loop()
    errors: list[Any] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        waits = OverdueWaits("add GPUs")
        now = time.monotonic()
        later, first, answered, settled = (loop.create_future() for _ in range(4))
        overdue = waits.add(loop, later, 0.1, now + 30)
        assert waits.add(loop, first, 0.1, now + 0.001) is overdue  # one look per event loop; due before it looks
        for future in (answered, settled):
            waits.add(loop, future, 0.1, now + 0.05)
        overdue.drop(answered)
        settled.set_result("the answer")
        loop.run_until_complete(asyncio.sleep(0.3))
        assert isinstance(first.exception(), RequestTimeout)
        assert "no answer within 100 ms: add GPUs" in str(first.exception())
        assert not later.done() and not answered.done() and settled.result() == "the answer"
        assert not errors, errors
        for _ in range(5000):  # answered waits leave nothing behind: neither their futures nor their ticks
            gone = loop.create_future()
            waits.add(loop, gone, 0.1, time.monotonic() + 0.1)
            overdue.drop(gone)
        dropped = weakref.ref(gone)
        del gone
        gc.collect()
        assert dropped() is None and list(overdue.live) == [later] and len(overdue._ticks) == 1
        overdue.drop(later)
        assert not overdue.live and not overdue._ticks
    finally:
        loop.close()


def test_workers_are_woken_per_batch_not_per_request(engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """Single requests from many threads wake a worker when a window starts or a batch is full, not once each."""
    import compiler.serve.batcher as batcher_module

    wakeups: list[int] = []

    class Counting(threading.Condition):
        def notify(self, n: int = 1) -> None:
            wakeups.append(id(self))  # futures use conditions too: only the batcher's are counted below
            super().notify(n)

    monkeypatch.setattr(batcher_module.threading, "Condition", Counting)
    gate = threading.Event()
    recording = Recording(engines, gate)
    with DynamicBatcher(recording, max_batch=16, max_wait_ms=2000, workers=1) as batcher:  # type: ignore[arg-type]
        futures = [batcher.submit_async(rows(i)) for i in range(40)]
        gate.set()
        results = [f.result(timeout=10) for f in futures]
    assert [len(b) for b in recording.batches] == [16, 16, 8]  # full batches go at once, without the 2 s window
    assert 1 <= wakeups.count(id(batcher._cond)) <= 6  # one per request would be 40
    for i, out in enumerate(results):
        np.testing.assert_allclose(out, engines(rows(i)), rtol=1e-6)


def test_on_a_gpu_the_next_batch_starts_before_asyncio_callers_are_answered(engines: Engines) -> None:
    """Where the engines queue on a GPU, a worker starts the next ready batch before it hands out the last one's
    answers to asyncio callers (the event loop's work then overlaps the GPU), and answers thread callers
    first; every request still gets its own rows, in full batches."""
    events: list[str] = []
    gate = threading.Event()

    class OnGpu(Recording):
        queues_on_gpu = True  # type: ignore[assignment]  # CPU engines, as a GPU's would be driven

        def start_parts(self, calls: Any, wait: bool = True) -> Any:
            events.append(f"start {len(self.batches)}")
            return super().start_parts(calls, wait=wait)

    on_gpu = OnGpu(engines, gate)

    async def main() -> list[Any]:
        with DynamicBatcher(on_gpu, max_batch=4, max_wait_ms=1000, workers=1) as batcher:  # type: ignore[arg-type]
            tasks = []
            for i in range(12):
                task = asyncio.ensure_future(batcher.infer(rows(i)))
                task.add_done_callback(lambda _, i=i: events.append(f"answer {i // 4}"))
                tasks.append(task)
                await asyncio.sleep(0)  # the request is queued
                if i == 3:
                    assert await asyncio.to_thread(on_gpu.entered.wait, 5)  # batch 0 at the engines, the rest behind
            gate.set()
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [len(b) for b in on_gpu.batches] == [4, 4, 4]
    assert [e for e in events if e.startswith("start")] == ["start 0", "start 1", "start 2"]
    assert events.index("start 1") < events.index("answer 0") and events.index("start 2") < events.index("answer 1")
    for i, out in enumerate(results):
        np.testing.assert_allclose(out, engines(rows(i)), rtol=1e-6)

    events.clear()
    gate = threading.Event()
    on_gpu = OnGpu(engines, gate)
    with DynamicBatcher(on_gpu, max_batch=4, max_wait_ms=1000, workers=1) as batcher:  # type: ignore[arg-type]
        futures = []
        for i in range(8):
            future = batcher.submit_async(rows(i))
            future.add_done_callback(lambda _, i=i: events.append(f"answer {i // 4}"))
            futures.append(future)
            if i == 3:
                assert on_gpu.entered.wait(5)  # batch 0 at the engines, batch 1 ready behind it
        gate.set()
        for f in futures:
            f.result(timeout=10)
    assert events.index("answer 0") < events.index("start 1")  # thread callers are answered first


@pytest.mark.parametrize("at_once", [True, False], ids=["starts-at-once", "start-launches-kernels"])
def test_on_a_gpu_with_two_buffer_sets_a_worker_queues_the_next_batch_before_it_waits(
        engines: Engines, at_once: bool) -> None:
    """With two buffer sets per worker on a GPU, the worker starts batch 1 while batch 0 still runs (its finish
    held), for thread callers too: the next batch's copy overlaps the GPU. Not where ``start_parts`` launches the
    kernels itself (``starts_at_once`` False: eager torch). Every caller gets its own rows."""
    events: list[str] = []
    release = threading.Event()

    class TwoSets(Recording):
        queues_on_gpu = True  # type: ignore[assignment]  # CPU engines, as a GPU's would be driven
        buffer_sets = 2
        starts_at_once = at_once

        def start_parts(self, calls: Any, wait: bool = True) -> Any:
            number = len(self.batches)
            events.append(f"start {number}")
            finish = super().start_parts(calls, wait=wait)

            def held(read: Any = None) -> Any:
                try:
                    if number == 0:
                        assert release.wait(10), "the test never released batch 0"
                    events.append(f"finish {number}")
                finally:
                    answer = finish()  # the buffer set goes back even when the test fails
                return answer

            return held

    two = TwoSets(engines)
    with DynamicBatcher(two, max_batch=4, max_wait_ms=1000, workers=1) as batcher:  # type: ignore[arg-type]
        futures = [batcher.submit_async(rows(i)) for i in range(8)]
        deadline = time.monotonic() + 5
        while "start 1" not in events and time.monotonic() < (deadline if at_once else deadline - 4.7):
            time.sleep(0.01)
        started = list(events)
        release.set()
        results = [f.result(timeout=10) for f in futures]
    if at_once:
        assert started == ["start 0", "start 1"]  # batch 1 queued while batch 0 runs
        assert events == ["start 0", "start 1", "finish 0", "finish 1"]
    else:
        assert started == ["start 0"]
        assert events == ["start 0", "finish 0", "start 1", "finish 1"]
    for i, out in enumerate(results):
        np.testing.assert_allclose(out, engines(rows(i)), rtol=1e-6)


def test_a_worker_waits_for_a_running_batch_instead_of_polling_it(engines: Engines) -> None:
    """While a batch runs on a (modelled) GPU for 0.3 s with two buffer sets per worker, the batcher waits for it
    once, without the GIL, instead of asking ``ready()`` every 0.1 ms between looks for the next batch (about 3,000
    looks in 0.3 s, each a GIL acquisition that the threads launching, packing and answering waited behind); the
    answer arrives, and a second batch submitted meanwhile still starts while the first runs."""
    from compiler.serve.engines import Started

    looks: list[float] = []
    starts: list[float] = []

    class Slow(Recording):
        queues_on_gpu = True  # type: ignore[assignment]  # CPU engines, driven as a GPU's would be
        buffer_sets = 2
        starts_at_once = True

        def start_parts(self, calls: Any, wait: bool = True) -> Any:
            started = super().start_parts(calls, wait=wait)
            if started is None:
                return None
            starts.append(time.monotonic())
            done_at = time.monotonic() + 0.3

            def finish(read: Any = None) -> Any:
                time.sleep(max(0.0, done_at - time.monotonic()))  # the device's synchronize, without the GIL
                return started.finish() if read is None else started.finish(read)

            def ready() -> bool:
                looks.append(time.monotonic())
                return time.monotonic() >= done_at

            return Started(finish, ready)

    slow = Slow(engines)
    with DynamicBatcher(slow, max_batch=4, max_wait_ms=1, workers=1) as batcher:  # type: ignore[arg-type]
        first = [batcher.submit_async(rows(i)) for i in range(4)]
        time.sleep(0.05)
        second = [batcher.submit_async(rows(i)) for i in range(4, 8)]
        results = [f.result(timeout=10) for f in first + second]
    assert len(looks) <= 4, f"{len(looks)} looks at running batches"
    assert len(starts) == 2 and starts[1] - starts[0] < 0.2  # the second started while the first ran
    for i, out in enumerate(results):
        np.testing.assert_allclose(out, engines(rows(i)), rtol=1e-6)


def test_two_batchers_on_one_engines_never_wait_for_each_others_buffer_sets(engines: Engines) -> None:
    """Two batchers of two batches in flight each, sharing engines of two buffer sets: a worker that holds one set
    never waits for another (each would hold one and wait for the other's); every request is answered."""
    from compiler.serve.engines import Started

    class GpuLike(Recording):
        queues_on_gpu = True  # type: ignore[assignment]  # CPU engines, driven as a GPU's would be
        buffer_sets = 2
        starts_at_once = True

        def start_parts(self, calls: Any, wait: bool = True) -> Any:
            started = super().start_parts(calls, wait=wait)
            if started is None:
                return None
            done_at = time.monotonic() + 0.01  # "running on the GPU" for 10 ms
            return Started(started.finish, lambda: time.monotonic() > done_at)

    gpu_like = GpuLike(engines)
    first = DynamicBatcher(gpu_like, max_batch=4, max_wait_ms=1, workers=1, timeout=20)  # type: ignore[arg-type]
    second = DynamicBatcher(gpu_like, max_batch=4, max_wait_ms=1, workers=1, timeout=20)  # type: ignore[arg-type]
    answers: list[Any] = []

    def client(batcher: DynamicBatcher, i: int) -> None:
        for _ in range(25):
            answers.append((i, batcher.submit(rows(i), timeout=20)))

    threads = [threading.Thread(target=client, args=(b, i)) for i, b in enumerate([first, second] * 4)]
    for t in threads:
        t.start()
    join_all(threads, timeout=60)
    first.close()
    second.close()
    assert len(answers) == 200
    for i, out in answers:
        np.testing.assert_allclose(out, engines(rows(i)), rtol=1e-6)


