"""The process batcher on ONNX Runtime (CPU): requests from other processes through shared memory, one answer each."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compiler.core.errors import FeedError, InputError
from compiler.serve.engines import Engines
from compiler.serve.load import load
from compiler.serve.processes import ClientHandle, ProcessBatcher, RequestFailed
from compiler.serve.waits import BatcherClosed, RequestTimeout
from tests.builds import build_directory
from tests.compiler.serve.test_batcher import Recording, join_all
from tests.project import ROOT


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    directory = build_directory(tmp_path_factory.mktemp("process-batcher") / "mlp", "mlp")
    with load(directory, backend="onnxruntime", device="cpu") as engines:
        yield engines


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    directory = build_directory(tmp_path_factory.mktemp("process-batcher") / "tr", "transformer_encoder")
    with load(directory, backend="onnxruntime", device="cpu") as engines:
        yield engines


def rows(i: int, n: int = 1) -> np.ndarray:
    return np.full((n, 64), float(i), np.float32)


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


@pytest.mark.slow
def test_requests_from_two_processes_each_get_their_own_rows(engines: Engines) -> None:
    recording = Recording(engines)
    rng = np.random.default_rng(0)
    requests = [[rng.standard_normal((1, 64)).astype(np.float32) for _ in range(4)] for _ in range(2)]
    with ProcessBatcher(recording, capacity=8, max_wait_ms=20) as batcher:
        answers = from_client_processes(batcher, requests, timeout=60)
    assert [sorted(a) for a in answers] == [[0, 1, 2, 3]] * 2
    for p in range(2):  # each process's answers, matched to its requests by value
        process_answers = next(a for a in answers if np.allclose(a[0], engines(requests[p][0]), atol=1e-5))
        for i in range(4):
            np.testing.assert_allclose(process_answers[i], engines(requests[p][i]), rtol=1e-5, atol=1e-6)
    assert sum(len(b) for b in recording.batches) == 1 + 8  # the batcher's probe of the output sizes, then 8 rows
    assert len(recording.batches) < 1 + 8, "no request was packed with another"


def test_threads_of_one_client_many_rows_and_dicts(engines: Engines) -> None:
    requests = [rows(i, 1 + i % 3) for i in range(30)]
    answers: dict[int, Any] = {}
    with ProcessBatcher(engines, capacity=8, slot_rows=3, max_wait_ms=5, in_flight=2) as batcher:
        client = batcher.client_handle(6).connect()

        def one(first: int) -> None:
            for i in range(first, 30, 6):
                answers[i] = client.submit(requests[i])

        threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        join_all(threads, timeout=30)
        named = client.submit({"x": rows(7, 2)})
        client.close()
    for i, x in enumerate(requests):
        np.testing.assert_allclose(answers[i], engines(x), rtol=1e-5, atol=1e-6)
    assert list(named) == ["out"]
    np.testing.assert_allclose(named["out"], engines(rows(7, 2)), rtol=1e-5, atol=1e-6)


def test_coroutines_of_one_client_each_get_their_own_rows(engines: Engines) -> None:
    """40 coroutines on 6 slots: the ones without a slot wait for one; every answer is the caller's own, and no
    answered wait is left for the look that fails overdue ones."""
    requests = [rows(i, 1 + i % 2) for i in range(40)]

    async def main(client: Any) -> list[Any]:
        answers = await asyncio.gather(*(client.infer(x, timeout=20) for x in requests))
        overdue = client._overdue._by_loop.get(asyncio.get_running_loop(), lambda: None)()
        assert overdue is None or not overdue.live  # every answered wait was dropped (and a look since freed it)
        return answers

    with ProcessBatcher(engines, capacity=6, slot_rows=2, max_wait_ms=5) as batcher:
        client = batcher.client_handle(6).connect()
        answers = asyncio.run(main(client))
    for x, answer in zip(requests, answers, strict=True):
        np.testing.assert_allclose(answer, engines(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "feed-per-request"])
def test_requests_of_other_sequence_lengths_run_in_their_own_batches(transformer: Engines, gather: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch's rows reach the engines as one feed gathered from the slots, or (a large batch) a feed per
    request: both at each request's own sequence length."""
    import compiler.serve.processes.server

    if not gather:
        monkeypatch.setattr(compiler.serve.processes.server, "_GATHER_BYTES", 0)
    recording = Recording(transformer)
    feeds = [{"input_ids": np.full((1, n), i, np.int64), "attention_mask": np.ones((1, n), np.int64)}
             for i, n in enumerate((4, 4, 9, 4, 9))]
    answers: dict[int, Any] = {}
    with ProcessBatcher(recording, capacity=5, max_wait_ms=100) as batcher:
        client = batcher.client_handle(5).connect()
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, client.submit(feeds[i])))
                   for i in range(5)]
        for t in threads:
            t.start()
        join_all(threads, timeout=30)
    for i, feed in enumerate(feeds):
        assert answers[i]["out"].shape == (1, feed["input_ids"].shape[1], 64)
        np.testing.assert_allclose(answers[i]["out"], transformer(feed)["out"], rtol=1e-5, atol=1e-5)
    # the requests' threads may send in any order: which requests share a batch is what is checked
    assert sorted(tuple(sorted(b[:, 0].tolist())) for b in recording.batches[1:]) == [(0, 1, 3), (2, 4)]
    assert recording.parts == ([1, 1] if gather else [len(b) for b in recording.batches[1:]])
    with ProcessBatcher(transformer, capacity=1, max_wait_ms=0) as batcher:  # one slot, its views kept per shape
        client = batcher.client_handle(1).connect()
        for i, feed in enumerate(feeds + feeds[::-1]):
            np.testing.assert_allclose(client.submit(feed)["out"], transformer(feed)["out"], rtol=1e-5, atol=1e-5,
                                       err_msg=f"request {i}")


def test_bad_requests_fail_in_the_client_with_one_line(engines: Engines, transformer: Engines) -> None:
    with ProcessBatcher(engines, capacity=2) as batcher:
        client = batcher.client_handle(2).connect()
        with pytest.raises(FeedError, match="dtype float64, the model takes float32"):
            client.submit(np.zeros((1, 64)))
        with pytest.raises(FeedError, match="dimension 1 must be 64"):
            client.submit(np.zeros((1, 63), np.float32))
        with pytest.raises(FeedError, match="2 rows and a slot holds 1: split it, or make the batcher with slot_rows"):
            client.submit(rows(0, 2))
        with pytest.raises(FeedError, match=r"missing \['x'\], unknown \['y'\]"):
            client.submit({"y": rows(0)})
        np.testing.assert_allclose(client.submit(rows(3)), engines(rows(3)), rtol=1e-5, atol=1e-6)
    with ProcessBatcher(transformer, capacity=1) as batcher:
        client = batcher.client_handle(1).connect()
        with pytest.raises(FeedError, match=r"S = 40 is outside the range 1\.\.32"):
            client.submit({"input_ids": np.zeros((1, 40), np.int64), "attention_mask": np.ones((1, 40), np.int64)})
    with ProcessBatcher(engines, capacity=2) as batcher, pytest.raises(InputError, match="slots=3: 2 of the batcher"):
        batcher.client_handle(3)
    with pytest.raises(InputError, match="in_flight=0"):
        ProcessBatcher(engines, in_flight=0)


def test_a_client_process_imports_numpy_and_the_client_only() -> None:
    """What a client process imports to reach a batcher: never torch or ONNX Runtime (nor the serving engines)."""
    code = ("import sys, compiler.serve.processes; "
            "heavy = {'torch', 'onnxruntime', 'compiler.serve.engines'} & set(sys.modules); assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_the_client_refuses_a_bad_feed_with_the_message_engines_gives(engines: Engines, transformer: Engines) -> None:
    """One feed checker (``compiler.serve.feeds``): what ``Engines`` refuses, a client refuses with the same words."""
    bad = [(engines, np.zeros((1, 64))), (engines, np.zeros((1, 63), np.float32)),
           (engines, np.zeros((0, 64), np.float32)), (engines, {"y": rows(0)}), (engines, {"x": rows(0), "y": rows(0)}),
           (transformer, np.zeros((1, 4), np.int64)),
           (transformer, {"input_ids": np.zeros((2, 4), np.int64), "attention_mask": np.ones((1, 4), np.int64)}),
           (transformer, {"input_ids": np.zeros((1, 4), np.int64), "attention_mask": np.ones((1, 5), np.int64)})]
    with ProcessBatcher(engines, capacity=1) as mlp, ProcessBatcher(transformer, capacity=1) as tr:
        clients = {id(engines): mlp.client_handle(1).connect(), id(transformer): tr.client_handle(1).connect()}
        for model, x in bad:
            with pytest.raises(FeedError) as by_engines:
                model(x)
            with pytest.raises(FeedError) as by_client:
                clients[id(model)].submit(x)
            assert str(by_client.value) == str(by_engines.value)


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


def test_an_output_larger_than_its_slot_fails_its_batch_with_the_reason() -> None:
    from compiler.serve.load import engines_from_module

    with engines_from_module(FirstPositives(), ["x:Bx64"], buckets=(1, 4), device="cpu", contexts=1) as engines, \
            ProcessBatcher(engines, capacity=1, max_wait_ms=0) as batcher:
        room = batcher._model.outputs[0].largest[0]  # sized by the probe's random row
        client = batcher.client_handle(1).connect()
        few = np.where(np.arange(64) < room - 1, 1.0, -1.0).astype(np.float32)[None]
        np.testing.assert_allclose(client.submit(few), few[:, :room - 1] * 2)  # smaller than the room: fits
        with pytest.raises(RequestFailed, match=r"output '\w+' has shape \(1, 64\); a slot holds .* its data"):
            client.submit(np.ones((1, 64), np.float32))


def test_a_late_answer_times_out_and_its_slot_serves_again(engines: Engines) -> None:
    gate = threading.Event()
    slow = Slow(engines, gate)
    with ProcessBatcher(slow, capacity=1, max_wait_ms=0) as batcher:
        client = batcher.client_handle(1).connect()
        start = time.monotonic()
        with pytest.raises(RequestTimeout, match="no answer within 100 ms"):
            client.submit(rows(1), timeout=0.1)
        assert time.monotonic() - start < 5
        gate.set()  # the batch runs; its answer lands in the abandoned slot, which is then taken again
        np.testing.assert_allclose(client.submit(rows(2), timeout=10), engines(rows(2)), rtol=1e-5, atol=1e-6)


def test_a_late_answer_times_out_a_coroutine_and_its_slot_serves_again(engines: Engines) -> None:
    hold = threading.Event()
    with ProcessBatcher(Slow(engines, hold), capacity=1, max_wait_ms=0) as batcher:
        client = batcher.client_handle(1).connect()

        async def main() -> Any:
            start = time.monotonic()
            with pytest.raises(RequestTimeout, match=r"no answer within 100 ms: .*contexts \(in_flight\)"):
                await client.infer(rows(1), timeout=0.1)
            assert time.monotonic() - start < 5  # the event loop's look fails it (no asyncio timer per request)
            hold.set()
            return await client.infer(rows(2), timeout=10)

        np.testing.assert_allclose(asyncio.run(main()), engines(rows(2)), rtol=1e-5, atol=1e-6)


def test_a_failed_batch_fails_its_requests_with_the_reason(engines: Engines) -> None:
    gate = threading.Event()
    gate.set()
    with ProcessBatcher(Slow(engines, gate), capacity=2, max_wait_ms=0) as batcher:
        batcher.engines.fail = True
        client = batcher.client_handle(2).connect()
        with pytest.raises(RequestFailed, match="the batch failed: CUDA out of memory"):
            client.submit(rows(1), timeout=10)
        batcher.engines.fail = False
        np.testing.assert_allclose(client.submit(rows(2), timeout=10), engines(rows(2)), rtol=1e-5, atol=1e-6)


def test_callers_learn_at_once_when_the_batcher_process_is_gone(engines: Engines) -> None:
    hold = threading.Event()
    with ProcessBatcher(Slow(engines, hold), capacity=2, max_wait_ms=0) as batcher:
        client = batcher.client_handle(2).connect()
        result: dict[str, Any] = {}

        def send() -> None:
            try:
                result["answer"] = client.submit(rows(1), timeout=None)  # would wait forever for a dead batcher
            except Exception as err:
                result["error"] = err

        waiting = threading.Thread(target=send)
        waiting.start()
        assert batcher.engines.entered.wait(timeout=10)
        batcher._wakers[0].close()  # what the client sees of a batcher process that died: its pipe's end closes
        join_all([waiting], timeout=10)
        assert isinstance(result.get("error"), BatcherClosed) and "its process ended" in str(result["error"])
        with pytest.raises(BatcherClosed, match="its process ended"):
            client.submit(rows(2))
        hold.set()
    hold.clear()
    with ProcessBatcher(Slow(engines, hold), capacity=2, max_wait_ms=0) as batcher:  # the same for a coroutine
        client = batcher.client_handle(2).connect()

        async def main() -> None:
            waiting = asyncio.ensure_future(client.infer(rows(1), timeout=None))
            while not batcher.engines.entered.is_set():
                await asyncio.sleep(0.01)
            batcher._wakers[0].close()
            with pytest.raises(BatcherClosed, match="its process ended"):
                await asyncio.wait_for(waiting, 10)

        asyncio.run(main())
        hold.set()


def _send_and_hang(handle: ClientHandle, sent: Any) -> None:
    client = handle.connect()
    sent.set()
    client.submit(rows(1), timeout=None)


def _send_once(handle: ClientHandle, results: Any) -> None:
    results.put(handle.connect().submit(rows(2), timeout=30))


@pytest.mark.slow
def test_a_restarted_client_process_reuses_its_handle_after_the_dead_ones_answer(engines: Engines) -> None:
    """A supervisor restarts a worker that died with a request in flight and gives the new one the same handle: the
    slot waits for the dead request's answer (a second wake of it must not kill the new client), then serves."""
    hold = threading.Event()
    spawn = multiprocessing.get_context("spawn")
    with ProcessBatcher(Slow(engines, hold), capacity=1, max_wait_ms=0) as batcher:
        handle = batcher.client_handle(1)
        sent = spawn.Event()
        dead = spawn.Process(target=_send_and_hang, args=(handle, sent))
        dead.start()
        assert sent.wait(60) and batcher.engines.entered.wait(30)
        dead.terminate()
        dead.join(30)
        results = spawn.Queue()
        restarted = spawn.Process(target=_send_once, args=(handle, results))
        restarted.start()
        time.sleep(1.0)
        hold.set()  # the dead request's batch finishes; its answer reaches the restarted process
        answer = results.get(timeout=60)
        restarted.join(30)
    np.testing.assert_allclose(answer, engines(rows(2)), rtol=1e-5, atol=1e-6)


def test_closed_batcher_refuses_requests_and_leaves_no_file(engines: Engines, tmp_path: Path) -> None:
    batcher = ProcessBatcher(engines, capacity=3, shm_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "the shared memory's file outlives its creation (a crash would leak it)"
    handle = batcher.client_handle(1)
    client = handle.connect()
    np.testing.assert_allclose(client.submit(rows(3)), engines(rows(3)), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="connected already in this process"):
        handle.connect()
    late = batcher.client_handle(1).connect()
    spare = batcher.client_handle(1)
    late_checked = late._request(rows(1), None)  # checked before the close, sent after it: the write finds no reader
    batcher.close()
    with pytest.raises(BatcherClosed, match="the batcher is closed"):
        client.submit(rows(0))
    with pytest.raises(BatcherClosed):
        late._send(late._take_slot(time.monotonic() + 1), *late_checked[2:], time.monotonic() + 1)
    with pytest.raises(BatcherClosed, match="was closed"):
        spare.connect()
    with pytest.raises(BatcherClosed, match="make a new one"):
        batcher.client_handle(1)
    client.close()
    with pytest.raises(BatcherClosed, match="this client is closed"):
        client.submit(rows(0))


def test_in_flight_beyond_the_buffer_sets_is_refused(engines: Engines) -> None:
    assert engines.buffer_sets == 2  # two CPU contexts, one set each
    with ProcessBatcher(engines, capacity=1) as batcher:
        assert batcher.in_flight == 1  # on the CPU a batch runs in start_parts: a second would delay the answers
    with pytest.raises(InputError, match=r"in_flight=3 but the engines have 2 buffer set\(s\) \(2 context"):
        ProcessBatcher(engines, in_flight=3)
    with ProcessBatcher(engines, capacity=1) as batcher, pytest.raises(InputError, match="slots=0: a client needs"):
        batcher.client_handle(0)


def test_a_batcher_that_stops_on_a_bug_fails_its_requests_at_once(engines: Engines,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: ProcessBatcher, now: float) -> Any:
        raise RuntimeError("a bug")

    with ProcessBatcher(engines, capacity=1, max_wait_ms=0) as batcher:
        client = batcher.client_handle(1).connect()
        monkeypatch.setattr(ProcessBatcher, "_take", broken)
        start = time.monotonic()
        with pytest.raises(RequestFailed, match="the batcher stopped: RuntimeError: a bug"):
            client.submit(rows(1), timeout=None)
        assert time.monotonic() - start < 5
        with pytest.raises(BatcherClosed):
            client.submit(rows(1))


def test_too_little_shared_memory_is_one_line_before_any_write(engines: Engines, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(InputError, match=r"MiB free and the batcher's slots need .* lower capacity or slot_rows, or "
                                         r"give the container more shared memory \(docker run --shm-size\)"):
        ProcessBatcher(engines, capacity=4, shm_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "the half-made shared memory file was left behind"


def test_close_without_draining_fails_queued_requests(engines: Engines) -> None:
    gate = threading.Event()
    slow = Slow(engines, gate)
    batcher = ProcessBatcher(slow, capacity=2, max_wait_ms=0, max_batch=1)
    client = batcher.client_handle(2).connect()
    results: dict[str, Any] = {}

    def send(name: str, i: int) -> None:
        try:
            results[name] = client.submit(rows(i), timeout=20)
        except Exception as err:
            results[name] = err

    running = threading.Thread(target=send, args=("running", 0))
    running.start()
    assert slow.entered.wait(timeout=10)
    queued = threading.Thread(target=send, args=("queued", 1))
    queued.start()
    time.sleep(0.2)
    closer = threading.Thread(target=batcher.close, kwargs={"drain": False})
    closer.start()
    deadline = time.monotonic() + 10
    while not batcher._closed and time.monotonic() < deadline:  # closed before the running batch ends (after a fixed
        time.sleep(0.005)  # sleep a loaded machine could release it first, and the queued request would then run)
    gate.set()
    join_all([closer, running, queued], timeout=20)
    np.testing.assert_allclose(results["running"], engines(rows(0)), rtol=1e-5, atol=1e-6)
    assert isinstance(results["queued"], BatcherClosed)


def _send_all(client: Any, requests: dict[int, tuple[np.ndarray, float]], results: dict[int, Any],
              pause: float = 0.0) -> list[threading.Thread]:
    """A thread per request (value, timeout), started ``pause`` seconds apart; each answer or error in ``results``."""
    def send(i: int) -> None:
        x, timeout = requests[i]
        try:
            results[i] = client.submit(x, timeout=timeout)
        except Exception as err:
            results[i] = err

    threads = []
    for i in requests:
        threads.append(threading.Thread(target=send, args=(i,)))
        threads[-1].start()
        time.sleep(pause)
    return threads


def _gated(engines: Engines) -> tuple[Recording, threading.Event]:
    """Engines that record each batch and hold it until the gate opens; open for the batcher's probe of the outputs
    (call ``_close_gate`` once the batcher is made)."""
    gate = threading.Event()
    gate.set()
    return Recording(engines, gate), gate


def _close_gate(recording: Recording, gate: threading.Event) -> None:
    gate.clear()
    recording.entered.clear()
    recording.batches.clear()


def test_requests_that_expire_in_the_queue_are_answered_and_never_run(engines: Engines) -> None:
    recording, gate = _gated(engines)
    with ProcessBatcher(recording, capacity=4, max_wait_ms=0, max_batch=4) as batcher:
        _close_gate(recording, gate)
        client = batcher.client_handle(4).connect()
        results: dict[int, Any] = {}
        first = _send_all(client, {0: (rows(0), 10)}, results)
        assert recording.entered.wait(timeout=10)  # batch 0 held at the gate
        later = _send_all(client, {1: (rows(1), 0.3), 2: (rows(2), 0.3), 3: (rows(3), 10)}, results)
        time.sleep(0.6)  # 1 and 2 are past their time while batch 0 holds the engines
        gate.set()
        join_all(first + later, timeout=20)
    assert [tuple(b[:, 0]) for b in recording.batches] == [(0.0,), (3.0,)]
    for i in (1, 2):
        assert isinstance(results[i], RequestTimeout) and "waited in the queue" in str(results[i])
    for i in (0, 3):
        np.testing.assert_allclose(results[i], engines(rows(i)), rtol=1e-5, atol=1e-6)


def test_a_request_too_large_for_the_batch_leaves_room_for_a_later_smaller_one(engines: Engines) -> None:
    recording, gate = _gated(engines)
    with ProcessBatcher(recording, capacity=4, slot_rows=3, max_wait_ms=0, max_batch=4) as batcher:
        _close_gate(recording, gate)
        client = batcher.client_handle(4).connect()
        results: dict[int, Any] = {}
        threads = _send_all(client, {0: (rows(0), 10)}, results)
        assert recording.entered.wait(timeout=10)
        threads += _send_all(client, {1: (rows(1, 3), 10), 2: (rows(2, 3), 10), 3: (rows(3), 10)}, results,
                             pause=0.05)
        time.sleep(0.2)  # all three queued, in that order, while batch 0 holds the engines
        gate.set()
        join_all(threads, timeout=20)
    # first fit in arrival order: 1 (3 rows), 2 does not fit beside it, 3 (1 row) does
    assert [tuple(b[:, 0]) for b in recording.batches[1:]] == [(1.0, 1.0, 1.0, 3.0), (2.0, 2.0, 2.0)]
    for i, n in ((1, 3), (2, 3), (3, 1)):
        np.testing.assert_allclose(results[i], engines(rows(i, n)), rtol=1e-5, atol=1e-6)


def test_cpu_seconds_is_the_batcher_threads_work_and_stays_after_it_stops(engines: Engines) -> None:
    batcher = ProcessBatcher(engines, capacity=4, max_wait_ms=1)
    client = batcher.client_handle(4).connect()
    before = batcher.cpu_seconds
    for i in range(200):  # on the CPU the engines compute on the batcher's thread
        client.submit(rows(i % 7))
    busy = batcher.cpu_seconds
    assert busy > before, "the batcher's thread did the work of 200 batches"
    batcher.close()
    assert batcher.cpu_seconds >= busy  # its total, not 0.0, once it stopped
    assert batcher.cpu_seconds == batcher.cpu_seconds


class Held(Recording):
    """CPU engines driven as a GPU's: a batch numbered in ``released`` (by ``start_parts`` calls, 0 being the
    batcher's probe of the output sizes) is not done (``ready``) and does not finish until its event is set;
    ``events`` notes each start and each finish."""

    queues_on_gpu = True  # type: ignore[assignment]
    buffer_sets = 2

    def __init__(self, engines: Engines, events: list[str], released: dict[int, threading.Event]) -> None:
        super().__init__(engines)
        self.events, self.released = events, released

    def start_parts(self, calls: Any, wait: bool = True) -> Any:
        from compiler.serve.engines import Started

        number = len(self.batches)
        self.events.append(f"start {number}")
        finish = super().start_parts(calls, wait=wait)
        release = self.released.get(number)
        if release is None:
            return finish

        def held(read: Any = None) -> Any:
            try:
                assert release.wait(10), f"the test never released batch {number}"
                self.events.append(f"finish {number}")
            finally:
                answer = finish(read)  # the buffer set goes back even when the test fails
            return answer

        return Started(held, release.is_set)


def four_requests(client: Any, first: int, answers: dict[int, Any], events: list[str] | None = None,
                  until: str = "") -> list[threading.Thread]:
    """Rows ``first`` to ``first + 3`` sent from a thread each, the answers (or errors) into ``answers``; returns
    the started threads once ``until`` is in ``events`` (a batch started)."""
    def one(i: int) -> None:
        try:
            answers[i] = client.submit(rows(i), timeout=20)
        except Exception as err:  # what the caller learns is the test's to check
            answers[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(first, first + 4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while events is not None and until not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events is None or until in events, events
    return threads


def test_the_next_batch_starts_while_the_last_one_runs(engines: Engines) -> None:
    """With room for a second batch, the batcher's thread does not wait for a running batch (not ``ready``): a batch
    that becomes full meanwhile starts at once, before the first is finished; both answer their own callers."""
    events: list[str] = []
    release = threading.Event()
    with ProcessBatcher(Held(engines, events, {1: release}), capacity=8, max_batch=4, max_wait_ms=1000) as batcher:
        assert batcher.in_flight == 2
        client = batcher.client_handle(8).connect()
        answers: dict[int, Any] = {}
        threads = four_requests(client, 0, answers, events, "start 1")
        threads += four_requests(client, 4, answers, events, "start 2")  # started while batch 1 is held
        started = list(events)
        release.set()
        assert started == ["start 1", "start 2"]  # batch 2 started while batch 1 still ran
        join_all(threads, timeout=20)
        client.close()
    assert events == ["start 1", "start 2", "finish 1"]
    for i in range(8):
        np.testing.assert_allclose(answers[i], engines(rows(i)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("second_done_first", [False, True])
def test_a_finished_batch_is_answered_before_the_next_starts_while_the_gpu_runs_another(
        engines: Engines, second_done_first: bool) -> None:
    """When batch 1 finishes while batch 2 still runs, its callers are woken before batch 3 starts (the start would
    delay every answer); when batch 2 is done already (the GPU would idle), batch 3 starts first."""
    events: list[str] = []
    released = {1: threading.Event(), 2: threading.Event()}
    with ProcessBatcher(Held(engines, events, released), capacity=12, max_batch=4, max_wait_ms=1000) as batcher:
        wake = batcher._wake
        batcher._wake = lambda slots: (events.append(f"wake {sorted(slots.tolist())}"), wake(slots))[1]
        client = batcher.client_handle(12).connect()
        answers: dict[int, Any] = {}
        threads = four_requests(client, 0, answers, events, "start 1")
        threads += four_requests(client, 4, answers, events, "start 2")  # started while batch 1 is held
        threads += four_requests(client, 8, answers)  # batch 3: two in flight already, it waits for batch 1
        time.sleep(0.2)  # batch 3's requests are in the pipe
        if second_done_first:
            released[2].set()
        released[1].set()
        deadline = time.monotonic() + 10
        while "start 3" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        released[2].set()
        join_all(threads, timeout=20)
        client.close()
    assert "start 3" in events and events.count("wake [0, 1, 2, 3]") == 1, events  # batch 1 woken once
    first_wake = next(e for e in events if e.startswith("wake"))
    assert first_wake == "wake [0, 1, 2, 3]", events
    order = events.index(first_wake) < events.index("start 3")
    assert order != second_done_first, events  # woken first while batch 2 ran; started first once it was done


def test_a_finished_batch_is_answered_when_the_look_at_the_next_one_fails(engines: Engines) -> None:
    """The batcher's look at whether the batch behind a finished one is done can fail (a broken GPU): the finished
    batch's callers are still woken with their answers (not left to find them once the batcher's pipes close, which
    forked clients never see); those of the batch behind it learn why the batcher stopped."""
    from compiler.serve.engines import Started

    events: list[str] = []
    release = threading.Event()

    class Broken(Held):
        def start_parts(self, calls: Any, wait: bool = True) -> Any:
            started = super().start_parts(calls, wait=wait)
            if len(self.batches) != 3:  # batch 2 (the third call, after the probe)
                return started

            def broken() -> bool:
                raise RuntimeError("the GPU is gone")

            return Started(started.finish, broken)

    answers: dict[int, Any] = {}

    with ProcessBatcher(Broken(engines, events, {1: release}), capacity=8, max_batch=4, max_wait_ms=1000) as batcher:
        wake = batcher._wake
        batcher._wake = lambda slots: (events.append(f"wake {sorted(slots.tolist())}"), wake(slots))[1]
        client = batcher.client_handle(8).connect()
        threads = four_requests(client, 0, answers, events, "start 1")
        threads += four_requests(client, 4, answers, events, "start 2")  # started while batch 1 is held
        release.set()
        join_all(threads, timeout=20)
        client.close()
    assert "wake [0, 1, 2, 3]" in events, events
    for i in range(4):
        np.testing.assert_allclose(answers[i], engines(rows(i)), rtol=1e-5, atol=1e-6)
    for i in range(4, 8):
        assert isinstance(answers[i], RequestFailed) and "the GPU is gone" in str(answers[i]), answers[i]


class IntoAreas(Recording):
    """CPU engines driven as a GPU's: the outputs of a batch given results areas (``out``) are copied there, as the
    GPU's copy would put them, and read from there."""

    queues_on_gpu = True  # type: ignore[assignment]
    buffer_sets = 2

    def start_parts(self, calls: Any, wait: bool = True, out: Any = None) -> Any:
        from compiler.serve.engines import Started

        started = super().start_parts(calls, wait=wait)
        if out is None or started is None:
            return started
        self.into_areas += 1

        def copy(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            views = {name: out[name][:a.size].reshape(a.shape) for name, a in outputs.items()}
            for name, a in outputs.items():
                views[name][...] = a
            return views

        return Started(lambda read=None: started(lambda o: copy(o) if read is None else read(copy(o))), started.ready)

    into_areas = 0


def test_on_a_gpu_answers_are_read_where_the_gpu_copied_them(engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's outputs go into a results area of the shared memory (page-locked on a real GPU) instead of being
    written into every slot; each client copies its rows from there and marks them taken, and an area serves the
    next batches only once every answer in it was taken, or its requests' time is over. A client whose area was
    reused before it read it gets an error, never another request's rows."""
    import compiler.serve.processes.server as server

    monkeypatch.setattr(server, "page_lock", lambda areas, device: 1)  # the CUDA call; the protocol is tested
    monkeypatch.setattr(server, "page_unlock", lambda address, device: None)
    into = IntoAreas(engines)
    requests = [rows(i, 1 + i % 2) for i in range(60)]
    answers: dict[int, Any] = {}
    with ProcessBatcher(into, capacity=8, slot_rows=2, max_batch=4, max_wait_ms=2) as batcher:
        assert batcher.in_flight == 2 and len(batcher._results) == 4
        client = batcher.client_handle(8).connect()

        def one(first: int) -> None:
            for i in range(first, len(requests), 8):
                answers[i] = client.submit(requests[i], timeout=20)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        join_all(threads, timeout=60)
        assert into.into_areas > len(batcher._results)  # the areas served again once read
        arrays = batcher._arrays
        answered = arrays["where"][:, 0] >= 0
        assert answered.any() and (arrays["taken"][answered] == arrays["answered"][answered]).all()
        assert batcher.batches_in_areas == into.into_areas and batcher.batches_in_slots <= into.into_areas // 4
        for readers in batcher._readers:  # every answer read: no area is held
            assert readers is None or (arrays["taken"][readers[0]] >= readers[1]).all()

        # an area whose readers never took their answers is not reused until their time is over
        area = 2
        unread = np.array([10**9])  # an answer number slot 0 has not read
        batcher._readers = [(np.array([0]), unread, time.monotonic() + 60)] * 4
        assert batcher._free_area() is None
        batcher._readers[area] = (np.array([0]), unread, time.monotonic() - 1)
        assert batcher._free_area() == area
        batcher._readers = [None] * 4

        # a client reading an area that was given to another batch meanwhile fails its request
        generation = arrays["generation"]
        real_read = client._answer

        def stalled(slot: int, number: int, rows_: int, single: bool) -> Any:
            generation[arrays["where"][slot, 0]] += 1  # the batcher reused the area while this process stalled
            return real_read(slot, number, rows_, single)

        client._answer = stalled  # type: ignore[method-assign]
        with pytest.raises(RequestFailed, match="overwritten before this client read it"):
            client.submit(rows(3), timeout=20)
        client._answer = real_read  # type: ignore[method-assign]
        np.testing.assert_allclose(client.submit(rows(4), timeout=20), engines(rows(4)), rtol=1e-5, atol=1e-6)
        client.close()
    for i, x in enumerate(requests):
        np.testing.assert_allclose(answers[i], engines(x), rtol=1e-5, atol=1e-6)

    # an answer nobody reads (its caller gave up, or the client closed) does not hold its area
    gate = threading.Event()
    gated = IntoAreas(engines)
    with ProcessBatcher(gated, capacity=3, max_wait_ms=0, timeout=None) as batcher:
        gated.gate = gate  # after the batcher's probe of the output sizes
        arrays = batcher._arrays

        def frees(area: int) -> bool:  # whether the batcher would give ``area`` to its next batch
            others = {i: r for i, r in enumerate(batcher._readers) if i != area}
            batcher._readers[:] = [batcher._readers[i] if i == area else server._FILLING for i in range(4)]
            try:
                return batcher._free_area() == area
            finally:
                for i, r in others.items():
                    batcher._readers[i] = r

        client = batcher.client_handle(1).connect()
        with pytest.raises(RequestTimeout):
            client.submit(rows(1), timeout=1.0)
        gate.set()  # its batch runs into an area; its caller is gone
        deadline = time.monotonic() + 20
        while arrays["answered"][0] != arrays["asked"][0] and time.monotonic() < deadline:
            time.sleep(0.01)
        area = int(arrays["where"][0, 0])
        assert area >= 0 and arrays["taken"][0] < arrays["answered"][0] and not frees(area)
        assert client._free_slot() == 0  # the slot serves again, its answer unread: the area is free
        assert arrays["taken"][0] == arrays["answered"][0] and frees(area)
        client._free.put(0)

        closing = batcher.client_handle(1).connect()  # an answer still unread when its client closes
        number = closing._send(1, [rows(2)], 1, [], math.inf)
        while arrays["answered"][1] != number and time.monotonic() < deadline:
            time.sleep(0.01)
        area = int(arrays["where"][1, 0])
        readers = batcher._readers[area]
        assert readers is not None and readers[2] <= time.monotonic() + 10  # no timeout: held at most 10 s
        assert not frees(area)
        closing.close()
        assert arrays["taken"][1] == number and frees(area)
        batcher._readers[area] = (np.array([1]), np.array([number]), math.inf)
        arrays["taken"][1] = number + 1  # the slot read a later answer: this one counts as read too
        assert frees(area)
        np.testing.assert_allclose(client.submit(rows(4), timeout=20), engines(rows(4)), rtol=1e-5, atol=1e-6)
        client.close()

    class NoOut(Recording):  # engines that queue on a GPU but copy into no results area
        queues_on_gpu = True  # type: ignore[assignment]
        buffer_sets = 2

    with ProcessBatcher(NoOut(engines), capacity=2, max_wait_ms=0) as batcher:
        assert not batcher._results
        client = batcher.client_handle(2).connect()
        np.testing.assert_allclose(client.submit(rows(5), timeout=20), engines(rows(5)), rtol=1e-5, atol=1e-6)
        assert (batcher.batches_in_areas, batcher.batches_in_slots) == (0, 1)
        client.close()


@pytest.mark.gpu
def test_on_a_real_gpu_the_outputs_are_copied_into_the_page_locked_results_areas() -> None:
    """Torch's CUDA graphs behind the batcher: the shared memory's results areas are page-locked, the GPU copies
    each batch's outputs there, and every caller (threads of a spawned client process) reads its own rows."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    from compiler.serve.load import engines_from_module
    from examples import models

    rng = np.random.default_rng(2)
    requests = [[rng.standard_normal((1, 64)).astype(np.float32) for _ in range(16)] for _ in range(2)]
    with engines_from_module(models.mlp(), ["x:Bx64"], buckets=(1, 4, 8), device="cuda", contexts=1) as engines, \
            ProcessBatcher(engines, capacity=32, max_wait_ms=2) as batcher:
        assert batcher._locked and len(batcher._results) == batcher.in_flight + 2 == 4
        answers = from_client_processes(batcher, requests, timeout=120)
        arrays = batcher._arrays
        assert (arrays["where"][:32, 0] >= 0).any()  # answered from the areas
        assert batcher.batches_in_areas > 0 and batcher.batches_in_slots <= batcher.batches_in_areas // 4
        assert (arrays["taken"] == arrays["answered"])[arrays["where"][:, 0] >= 0].all()
        for answer in answers:
            p = next(p for p in range(2) if np.allclose(answer[0], engines(requests[p][0]), atol=1e-3))
            for i in range(16):
                np.testing.assert_allclose(answer[i], engines(requests[p][i]), rtol=1e-3, atol=1e-3)


def test_an_output_larger_than_its_slot_fails_through_a_results_area_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A results area may have room for an output its slot would not hold; the request fails the same way."""
    import compiler.serve.processes.server as server
    from compiler.serve.load import engines_from_module

    monkeypatch.setattr(server, "page_lock", lambda areas, device: 1)
    monkeypatch.setattr(server, "page_unlock", lambda address, device: None)
    with engines_from_module(FirstPositives(), ["x:Bx64"], buckets=(1, 4), device="cpu", contexts=1) as engines, \
            ProcessBatcher(IntoAreas(engines), capacity=1, max_wait_ms=0) as batcher:
        room = batcher._model.outputs[0].largest[0]
        assert batcher._results and 4 * room >= 64  # the area holds a row of 64
        client = batcher.client_handle(1).connect()
        few = np.where(np.arange(64) < room - 1, 1.0, -1.0).astype(np.float32)[None]
        np.testing.assert_allclose(client.submit(few), few[:, :room - 1] * 2)
        assert batcher._arrays["where"][0, 0] >= 0  # answered from the area
        with pytest.raises(RequestFailed, match=r"output '\w+' has shape \(1, 64\); a slot holds .* its data"):
            client.submit(np.ones((1, 64), np.float32))
        client.close()
