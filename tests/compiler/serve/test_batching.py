"""The batch-formation policy both batchers use (``compiler.serve.batching``), on queues given as arrays."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.core.errors import InputError
from compiler.serve.batching import BatchPolicy, first_fit

FAR = 1e12  # a deadline never reached


def queue(rows: list[int], signatures: list[int] | None = None, deadlines: list[float] | None = None,
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(rows)
    codes = np.asarray(signatures, np.int64).reshape(-1, 1) if signatures is not None else np.empty((n, 0), np.int64)
    return np.asarray(rows, np.int64), codes, np.asarray(deadlines or [FAR] * n, np.float64)


def test_a_batch_is_ready_when_full_or_when_its_window_is_over() -> None:
    policy = BatchPolicy(max_batch=8, max_wait=0.005)
    assert not policy.ready(queued_rows=7, first_submitted=10.0, now=10.004)
    assert policy.ready(queued_rows=8, first_submitted=10.0, now=10.0)
    assert policy.ready(queued_rows=1, first_submitted=10.0, now=10.005)
    assert policy.window_end(10.0) == pytest.approx(10.005)


def test_a_padded_queue_waits_while_a_batch_runs_and_counts_its_window_from_the_answers() -> None:
    """With buckets 16 and 64, a queue of 34 rows would run padded to 64: while a batch runs it is not ready, even with
    its window over; once that batch is answered its window counts from the answers (the callers answered can join
    it); a queue of 16 (a bucket's size) or 64 (full) is ready as before, running or not."""
    policy = BatchPolicy(max_batch=64, max_wait=0.005, buckets=(16, 64))
    assert policy.padded(34) and not policy.padded(16) and not policy.padded(64)
    assert not policy.ready(34, first_submitted=10.0, now=10.1, running=True)
    assert not policy.ready(34, first_submitted=10.0, now=10.103, answered=10.1)
    assert policy.ready(34, first_submitted=10.0, now=10.105, answered=10.1)
    assert policy.window_end(10.0, answered=10.1, padded=True) == pytest.approx(10.105)
    assert policy.ready(16, first_submitted=10.0, now=10.1, running=True, answered=10.1)
    assert policy.ready(64, first_submitted=10.0, now=10.0, running=True)
    assert BatchPolicy(64, 0.005).ready(34, first_submitted=10.0, now=10.1, running=True)  # no buckets: never padded


def test_single_rows_fill_the_batch_in_queue_order() -> None:
    taken = BatchPolicy(4, 0.0).take(*queue([1] * 6), now=0.0)
    assert taken.batch.tolist() == [0, 1, 2, 3] and taken.rows == 4
    assert taken.left.tolist() == [False] * 4 + [True] * 2 and not len(taken.expired)


def test_first_fit_leaves_room_for_later_smaller_requests() -> None:
    """3 + 3 would overflow 4 rows: the second 3 waits and the 1 behind it joins; the first goes even when larger."""
    taken = BatchPolicy(4, 0.0).take(*queue([3, 3, 1, 1]), now=0.0)
    assert taken.batch.tolist() == [0, 2] and taken.rows == 4
    assert taken.left.tolist() == [False, True, False, True]
    oversized = BatchPolicy(4, 0.0).take(*queue([6, 1]), now=0.0)
    assert oversized.batch.tolist() == [0] and oversized.rows == 6
    assert first_fit(np.array([2, 1, 2, 1]), 4)[1] == 4


def test_only_requests_of_the_first_ones_signature_share_its_batch() -> None:
    taken = BatchPolicy(8, 0.0).take(*queue([1, 1, 1, 1], signatures=[7, 9, 7, 9]), now=0.0)
    assert taken.batch.tolist() == [0, 2] and taken.left.tolist() == [False, True, False, True]
    several = np.array([[4, 2], [4, 3], [4, 2]], np.int64)  # two dynamic sizes per request
    rows, _, deadlines = queue([1, 1, 1])
    assert BatchPolicy(8, 0.0).take(rows, several, deadlines, now=0.0).batch.tolist() == [0, 2]


def test_expired_requests_leave_the_queue_and_the_first_live_one_sets_the_signature() -> None:
    taken = BatchPolicy(8, 0.0).take(*queue([1, 1, 1, 1], signatures=[5, 6, 5, 6], deadlines=[1.0, FAR, 2.0, FAR]),
                                     now=3.0)
    assert taken.expired.tolist() == [0, 2] and taken.batch.tolist() == [1, 3] and not taken.left.any()
    everything = BatchPolicy(8, 0.0).take(*queue([1, 1], deadlines=[1.0, 1.0]), now=3.0)
    assert everything.expired.tolist() == [0, 1] and not len(everything.batch) and everything.rows == 0


def test_a_full_batch_of_the_first_requests_is_the_whole_queues() -> None:
    """What lets ``DynamicBatcher`` give the policy its first ``max_batch`` requests only."""
    rng = np.random.default_rng(0)
    policy = BatchPolicy(8, 0.0)
    for _ in range(200):
        rows, codes, deadlines = queue(rng.integers(1, 4, 30).tolist(), rng.integers(0, 2, 30).tolist())
        whole = policy.take(rows, codes, deadlines, now=0.0)
        first = policy.take(rows[:8], codes[:8], deadlines[:8], now=0.0)
        if first.rows >= 8:
            assert first.batch.tolist() == whole.batch.tolist()


def test_bad_settings_are_refused_with_what_to_change() -> None:
    with pytest.raises(InputError, match="max_batch=0"):
        BatchPolicy.of((1, 8), max_batch=0, max_wait_ms=1.0, timeout=1.0)
    with pytest.raises(InputError, match="max_wait_ms=-1"):
        BatchPolicy.of((1, 8), max_batch=None, max_wait_ms=-1, timeout=1.0)
    with pytest.raises(InputError, match="timeout=0"):
        BatchPolicy.of((1, 8), max_batch=None, max_wait_ms=1.0, timeout=0)
    assert BatchPolicy.of((1, 8), max_batch=None, max_wait_ms=5.0, timeout=None) == BatchPolicy(8, 0.005, (1, 8))
