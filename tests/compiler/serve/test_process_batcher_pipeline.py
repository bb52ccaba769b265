"""The process batcher's batches: requests that expire in the queue, first fit, the batcher thread's CPU time,
the next batch started while the last runs, and answers read where the GPU copied them (results areas)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from compiler.serve.engines import Engines
from compiler.serve.processes import ProcessBatcher, RequestFailed
from compiler.serve.waits import RequestTimeout
from tests.compiler.serve.helpers import (
    FirstPositives,
    Recording,
    from_client_processes,
    join_all,
    rows,
)


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
