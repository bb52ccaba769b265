"""The process batcher on ONNX Runtime (CPU): requests from other processes through shared memory, one answer each."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compiler.core.errors import FeedError, InputError
from compiler.serve.engines import Engines
from compiler.serve.processes import ClientHandle, ProcessBatcher, RequestFailed
from compiler.serve.waits import BatcherClosed, RequestTimeout
from tests.compiler.serve.helpers import (
    FirstPositives,
    Recording,
    Slow,
    from_client_processes,
    join_all,
    rows,
)
from tests.project import ROOT


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


