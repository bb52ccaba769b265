"""Calibration streams data in bounded memory: batches sliced to a budget, max |x| reduced inside the graph."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from calibration import observe
from calibration.observe import collect_histograms, collect_max_abs
from compiler.core.errors import CalibrationError
from compiler.core.onnx_io import ort_session
from tests.calibration.test_statistics import _mlp, _mlp_batches


def test_max_abs_in_graph_matches_numpy_and_exposes_only_scalars(monkeypatch: pytest.MonkeyPatch) -> None:
    sessions: list[Any] = []

    def recording_session(*args: Any, **kwargs: Any) -> Any:
        sessions.append(ort_session(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(observe, "ort_session", recording_session)
    model, batches = _mlp(), _mlp_batches(5)
    maxima = collect_max_abs(model, ["x", "h", "r", "y"], batches)
    reference = ort_session(model)
    w1 = np.asarray(__import__("onnx").numpy_helper.to_array(model.graph.initializer[0]))
    for b in batches:
        assert maxima["x"] >= np.abs(b["x"]).max()
    expected_h = max(float(np.abs(b["x"] @ w1).max()) for b in batches)
    expected_y = max(float(np.abs(reference.run(None, b)[0]).max()) for b in batches)
    assert maxima["h"] == pytest.approx(expected_h, rel=1e-5)
    assert maxima["r"] == pytest.approx(max(float(np.maximum(b["x"] @ w1, 0).max()) for b in batches), rel=1e-5)
    assert maxima["y"] == pytest.approx(expected_y, rel=1e-5)
    assert maxima["x"] == pytest.approx(max(float(np.abs(b["x"]).max()) for b in batches))
    assert all(o.shape == [] for o in sessions[0].get_outputs())  # one number per tensor leaves ONNX Runtime
    # the same numbers as the exposing path
    exposed = collect_max_abs(model, ["h", "r", "y"], batches, exclude_masked=True)
    assert exposed == pytest.approx({k: maxima[k] for k in exposed}, rel=1e-6)


def test_max_abs_in_graph_names_nan() -> None:
    batches = _mlp_batches(2)
    batches[1]["x"][0, 3] = np.nan
    with pytest.raises(CalibrationError, match="batch 1: tensor 'h' has NaN"):
        collect_max_abs(_mlp(), ["h"], batches)


def test_max_abs_runs_batches_whole_and_reports_their_samples() -> None:
    """The budget bounds exposed tensors; in-graph reductions expose none, so no batch is sliced."""
    model, batches = _mlp(), _mlp_batches(3)
    seen: list[int] = []
    maxima = collect_max_abs(model, ["h", "y"], batches, progress=seen.append, budget_bytes=1)
    assert seen == [len(b["x"]) for b in batches]
    assert maxima == collect_max_abs(model, ["h", "y"], batches)


def test_a_batch_over_the_budget_runs_in_slices_with_the_same_statistics() -> None:
    model, batches = _mlp(), _mlp_batches(4)
    whole_progress: list[int] = []
    sliced_progress: list[int] = []
    whole = collect_histograms(model, ["h", "r"], batches, progress=whole_progress.append)
    # h and r are 2 x 32 floats a sample: 256 bytes; a 600-byte budget takes 2 samples a run
    sliced = collect_histograms(model, ["h", "r"], batches, progress=sliced_progress.append, budget_bytes=600)
    assert whole_progress == [len(b["x"]) for b in batches]
    assert max(sliced_progress) == 2 and sum(sliced_progress) == sum(whole_progress)
    assert (sliced.batches, sliced.samples) == (whole.batches, whole.samples)
    for name in ("h", "r"):
        assert sliced.histograms[name].amax == whole.histograms[name].amax
        assert sliced.histograms[name].count == whole.histograms[name].count
    assert sliced.amax("max") == whole.amax("max")


def test_histograms_and_max_abs_come_from_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_abs_names: the same max |x| as collect_max_abs, the same histograms, one session, one pass."""
    sessions: list[Any] = []

    def recording_session(*args: Any, **kwargs: Any) -> Any:
        sessions.append(ort_session(*args, **kwargs))
        return sessions[-1]

    model, batches = _mlp(), _mlp_batches(4)
    taken: list[int] = []

    def counted() -> Any:
        for b in batches:
            taken.append(1)
            yield b

    separate = collect_histograms(model, ["h", "r"], batches, budget_bytes=600)
    expected = collect_max_abs(model, ["x", "h", "r", "y"], batches)
    monkeypatch.setattr(observe, "ort_session", recording_session)
    # a 600-byte budget runs 2 samples at a time: the maxima of the slices fold into the batch's
    both = collect_histograms(model, ["h", "r"], counted(), budget_bytes=600, max_abs_names=["x", "h", "r", "y"])
    assert len(sessions) == 1 and len(taken) == len(batches)
    assert both.max_abs == expected  # in-graph reductions both ways: bit for bit
    assert expected["x"] == max(float(np.abs(b["x"]).max()) for b in batches)
    for name in ("h", "r"):
        np.testing.assert_array_equal(both.histograms[name].counts, separate.histograms[name].counts)
        assert both.histograms[name].amax == separate.histograms[name].amax
    assert both.amax("percentile") == separate.amax("percentile")
    # per max |x| tensor computed by a node, three scalar outputs: its bounds (max, min, sum), finite on these data,
    # so no session with the exact reductions was needed (x, a graph input, is read from the feed)
    assert sum(o.shape == [] for o in sessions[0].get_outputs()) == 3 * 3
    assert collect_histograms(model, ["h"], batches).max_abs is None


def test_one_pass_max_abs_counts_mask_biases_and_names_nan() -> None:
    from tests.calibration.test_statistics import _causal_model

    x = np.random.default_rng(10).standard_normal((3, 4, 4)).astype(np.float32)
    stats = collect_histograms(_causal_model(), ["biased"], [{"x": x}], max_abs_names=["biased", "shifted"])
    assert stats.histograms["biased"].amax < 10.0  # the -1e9 fill stays out of the histogram
    assert stats.max_abs is not None and stats.max_abs["biased"] == pytest.approx(1e9)  # but overflows FP16
    assert stats.max_abs == collect_max_abs(_causal_model(), ["biased", "shifted"], [{"x": x}])
    batches = _mlp_batches(2)
    batches[1]["x"][0, 3] = np.nan
    with pytest.raises(CalibrationError, match="batch 1: tensor 'y' has NaN"):
        collect_histograms(_mlp(), [], batches, max_abs_names=["y"])


def test_batches_after_the_first_of_a_shape_run_whole_in_slices_of_the_budget() -> None:
    """Proves: with a SampleBytes memo, the first batch of a sample shape runs as 1 + rest (the measurement), each
    later batch of that shape in slices of the budget from its first sample (here whole: 1 call), a batch of new
    sample shapes measures again, and the slices' outputs joined equal the batch's own outputs."""
    from calibration.slices import SampleBytes, sliced_runs

    calls: list[tuple[int, ...]] = []

    def run(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        calls.append(feed["x"].shape)
        return [feed["x"].reshape(len(feed["x"]), -1) * 2.0]

    known = SampleBytes()
    rng = np.random.default_rng(0)
    for batch, expected in ((rng.standard_normal((16, 3, 4), dtype=np.float32), [(1, 3, 4), (15, 3, 4)]),
                            (rng.standard_normal((16, 3, 4), dtype=np.float32), [(16, 3, 4)]),
                            (rng.standard_normal((8, 5, 4), dtype=np.float32), [(1, 5, 4), (7, 5, 4)])):
        calls.clear()
        parts = list(sliced_runs(run, {"x": batch}, 1 << 20, "batch", known=known))
        assert calls == expected
        joined = np.concatenate([outs[0] for _, _, outs in parts])
        np.testing.assert_array_equal(joined, batch.reshape(len(batch), -1) * 2.0)
    calls.clear()
    list(sliced_runs(run, {"x": np.zeros((16, 3, 4), np.float32)}, 2 * 12 * 4, "batch", known=known))
    assert calls == [(2, 3, 4)] * 8  # a budget of two samples' outputs: slices of 2 from the start
