"""Streaming |x| histograms, the amax methods, and collecting histograms through ONNX Runtime."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from calibration import observe, statistics
from calibration.observe import collect_histograms, collect_max_abs
from calibration.statistics import AMAX_FLOOR, AMAX_METHODS, AbsHistogram, amax_from_histogram
from compiler.core import defaults
from compiler.core.errors import CalibrationError
from compiler.core.onnx_io import ort_session, save_onnx
from tests.onnx_helpers import make_model, tensor


def _filled(batches: list[np.ndarray], num_bins: int = 2048) -> AbsHistogram:
    hist = AbsHistogram(num_bins)
    for batch in batches:
        hist.update(batch)
    return hist


# --- AbsHistogram ---------------------------------------------------------------------------------------------

def test_histogram_counts_every_value_and_tracks_the_exact_max() -> None:
    x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    hist = _filled(np.array_split(x, 20))
    assert hist.count == x.size
    assert int(hist.counts.sum()) == x.size
    assert hist.amax == float(np.abs(x).max())
    assert amax_from_histogram(hist, "max") == hist.amax


@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.99])
def test_percentile_is_within_a_bin_of_numpy(percentile: float) -> None:
    x = np.random.default_rng(1).standard_normal(1_000_000)
    hist = _filled(np.array_split(x, 20))
    expected = np.percentile(np.abs(x), percentile)
    assert abs(statistics._quantile_edge(hist, percentile) - expected) <= 1.001 * hist.bin_width


def test_growing_range_keeps_earlier_counts_and_the_percentile() -> None:
    rng = np.random.default_rng(2)
    small = [rng.uniform(-0.5, 0.5, 50_000) for _ in range(5)]
    large = [rng.standard_normal(50_000) * 3.0 for _ in range(15)]
    hist = _filled(small + large)
    x = np.abs(np.concatenate(small + large))
    assert hist.upper >= x.max() and hist.count == int(hist.counts.sum()) == x.size
    assert int(hist.counts[hist.edges[1:] <= 0.5].sum()) >= sum(b.size for b in small)  # small values stay low
    for percentile in (50.0, 99.0, 99.99):
        expected = np.percentile(x, percentile)
        assert abs(statistics._quantile_edge(hist, percentile) - expected) <= 1.001 * hist.bin_width


def test_growth_merges_bins_exactly() -> None:
    hist = _filled([np.array([0.1, -0.3, 0.6, 1.0])], num_bins=4)
    assert hist.upper == 1.0 and hist.counts.tolist() == [1, 1, 1, 1]
    hist.update(np.array([-2.5]))  # range grows by 3: bins 0-2 merge into bin 0, bin 3 into bin 1
    assert hist.upper == 3.0 and hist.counts.tolist() == [3, 1, 0, 1]
    assert hist.amax == 2.5 and hist.count == 5


def test_memory_stays_constant_over_many_growing_batches() -> None:
    hist = AbsHistogram()
    rng = np.random.default_rng(3)
    for i in range(300):
        hist.update(rng.standard_normal(100) * 1.1**i)
        assert hist.counts.shape == (2048,) and hist.counts.nbytes == 2048 * 8
    assert hist.count == 300 * 100


def test_empty_and_all_zero_histograms_give_the_floor() -> None:
    hist = AbsHistogram()
    hist.update(np.zeros((0, 3), dtype=np.float32))
    assert hist.count == 0
    assert all(amax_from_histogram(hist, method) == AMAX_FLOOR for method in AMAX_METHODS)
    hist.update(np.zeros(10))
    assert hist.count == 10 and hist.upper == 0.0 and hist.counts[0] == 10
    assert all(amax_from_histogram(hist, method) == AMAX_FLOOR for method in AMAX_METHODS)
    hist.update(np.array([0.0, 2.0]))  # zeros seen before the first range stay in bin 0
    assert hist.counts[0] == 11 and hist.counts[-1] == 1 and hist.upper == 2.0


def test_update_rejects_nan() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        AbsHistogram().update(np.array([1.0, np.nan]))


def test_percentile_clips_a_gaussian_tail_at_the_quantile() -> None:
    """99.99 % of a Gaussian: clipping the last 0.01 % costs less than INT8 rounding, so the quantile stands."""
    x = np.random.default_rng(1).standard_normal(1_000_000)
    hist = _filled(np.array_split(x, 20))
    expected = np.percentile(np.abs(x), 99.99)
    assert abs(amax_from_histogram(hist, "percentile", 99.99) - expected) <= 1.001 * hist.bin_width


def test_percentile_keeps_rare_massive_activations() -> None:
    """A [CLS]-like token with a value 60x the bulk in one channel: 1 value in 18 000, below what 99.99 % clips.

    Clipping it at the quantile (~4) would cost far more squared error than INT8 rounding saves, so the
    threshold rises until the two balance; the pure quantile was 15x lower.
    """
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(96):  # sentences of 48 tokens x 384 channels
        tokens = rng.standard_normal((48, 384))
        tokens[0, 308] = rng.uniform(250.0, 300.0)
        batches.append(tokens)
    hist = _filled(batches)
    quantile = statistics._quantile_edge(hist, 99.99)
    amax = amax_from_histogram(hist, "percentile", 99.99)
    assert quantile < 5.0
    assert amax > 150.0  # MSE balance: the massive value is clipped by < 40 %, not 98 %
    values = np.abs(np.concatenate([b.ravel() for b in batches]))
    rounding, clipping = statistics._error_terms(hist.counts.astype(np.float64),
                                                 np.arange(hist.num_bins + 1, dtype=np.float64),
                                                 np.array([amax / hist.bin_width]))
    assert clipping[0] <= rounding[0] and values.max() >= amax


def _reference_entropy_bins(counts: np.ndarray) -> int:
    """TensorRT's KL search written plainly (as ModelOpt's ``_compute_amax_entropy``), with scipy's KL."""
    from scipy.stats import entropy

    nonzero = np.flatnonzero(counts)
    filled = int(nonzero[-1]) + 1
    bins = counts[:filled].astype(np.float64)
    bins[0] = bins[1]
    if filled <= 128:
        return filled
    best, best_kl = filled, np.inf
    for i in range(128, filled + 1):
        p = bins[:i].copy()
        p[-1] += bins[i:].sum()
        levels = (np.arange(i) * 128) // i
        used = bins[:i] > 0
        sums = np.bincount(levels, weights=bins[:i], minlength=128)
        members = np.bincount(levels, weights=used, minlength=128)
        q = np.where(used, sums[levels] / np.maximum(members[levels], 1), 0.0)  # spread over the used bins
        kl = entropy(p, q) if q.sum() > 0 else np.inf
        if kl <= best_kl:
            best, best_kl = i, kl
    return best


@pytest.mark.parametrize("case", ["digits-0.3-0.4", "digits-0.3-0.3255", "digits-per-pixel", "laplace-wide",
                                  "relu-gaussian"])
def test_entropy_picks_the_kl_minimum_and_keeps_few_level_inputs_whole(case: str) -> None:
    """The threshold is the KL minimum (the largest one on ties), checked against a plain reimplementation.

    Inputs with few distinct values (the digits pixels, 17 levels) lose nothing at their max, so their KL
    minimum is the max: entropy must not clip them.
    """
    from sklearn.datasets import load_digits

    rng = np.random.default_rng(5)
    images = load_digits().images[:300].astype(np.float32)
    data = {
        "digits-0.3-0.4": (images / 16 - 0.3) / 0.4,
        "digits-0.3-0.3255": (images / 16 - 0.3) / 0.3255,  # max |x| 2.15, the background at 0.92
        "digits-per-pixel": np.nan_to_num((images - images.mean(0)) / (images.std(0) + 1e-6)),
        "laplace-wide": rng.laplace(0.0, 1.0, 400_000) * np.where(rng.random(400_000) < 1e-3, 50.0, 1.0),
        "relu-gaussian": np.maximum(rng.standard_normal(400_000), 0.0),
    }[case]
    hist = _filled(np.array_split(data.ravel(), 19))
    amax = amax_from_histogram(hist, "entropy")
    assert amax == pytest.approx(min(_reference_entropy_bins(hist.counts) * hist.bin_width, hist.amax))
    if case.startswith("digits-0.3"):
        assert amax == pytest.approx(hist.amax)


def test_unknown_method_and_bad_percentile_raise() -> None:
    hist = _filled([np.arange(10.0)])
    with pytest.raises(ValueError, match="unknown amax method 'minmax'"):
        amax_from_histogram(hist, "minmax")
    with pytest.raises(ValueError, match="percentile"):
        amax_from_histogram(hist, "percentile", 0.0)


def _gaussian_with_outliers(seed: int, outlier: float = 50.0) -> tuple[np.ndarray, np.ndarray]:
    bulk = np.random.default_rng(seed).standard_normal(1_000_000)
    return bulk, np.full(10, outlier)


@pytest.mark.parametrize("outliers_first", [True, False])
def test_entropy_clips_outliers_to_the_bulk(outliers_first: bool) -> None:
    bulk, outliers = _gaussian_with_outliers(4)
    parts = [outliers, *np.array_split(bulk, 10)] if outliers_first else [*np.array_split(bulk, 10), outliers]
    hist = _filled(parts)
    assert amax_from_histogram(hist, "max") == 50.0
    # TensorRT's KL search settles at 4-5 sigma of the bulk, far below the outliers.
    assert 3.5 < amax_from_histogram(hist, "entropy") < 6.0


def _int8_squared_error(x: np.ndarray, amax: float) -> float:
    step = amax / 127
    return float(np.mean((np.clip(np.round(x / step), -127, 127) * step - x) ** 2))


def test_mse_picks_the_threshold_of_least_squared_error_on_the_raw_values() -> None:
    bulk, outliers = _gaussian_with_outliers(5)
    x = np.concatenate([bulk[:200_000], outliers[:2]])
    hist = _filled([x])
    picked = amax_from_histogram(hist, "mse")
    grid_best = min(_int8_squared_error(x, t) for t in np.linspace(1.0, 50.0, 197))
    assert _int8_squared_error(x, picked) <= 1.02 * grid_best
    # clipping two outliers at 50 sigma beats widening the step for 200k values (max would not)
    assert picked < 0.75 * hist.amax
    assert _int8_squared_error(x, picked) < 0.8 * _int8_squared_error(x, hist.amax)


# --- collect_histograms on tiny ONNX models -------------------------------------------------------------------

def _mlp(width: int = 16) -> onnx.ModelProto:
    rng = np.random.default_rng(6)
    return make_model(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])],
        [tensor("x", ["B", width])], [tensor("y", ["B", 2])],
        {"w1": rng.standard_normal((width, 32)).astype(np.float32),
         "w2": rng.standard_normal((32, 2)).astype(np.float32)})


def _mlp_batches(n: int, width: int = 16) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal((4 + i % 3, width)).astype(np.float32)} for i in range(n)]


def test_histograms_match_a_direct_ort_run_and_only_requested_tensors_are_exposed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sessions: list[Any] = []

    def recording_session(*args: Any, **kwargs: Any) -> Any:
        sessions.append(ort_session(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(observe, "ort_session", recording_session)
    model, batches = _mlp(), _mlp_batches(6)
    seen: list[int] = []
    stats = collect_histograms(model, ["h"], iter(batches), progress=seen.append)
    assert [o.name for o in sessions[0].get_outputs()] == ["y", "h"]
    assert [o.name for o in model.graph.output] == ["y"]  # the caller's model is left alone
    sizes = [len(b["x"]) for b in batches]
    assert (stats.batches, stats.samples, sum(seen)) == (6, sum(sizes), sum(sizes))  # progress per slice

    reference_model = make_model(list(model.graph.node), list(model.graph.input), [tensor("h", ["B", 32])],
                                 {"w1": onnx.numpy_helper.to_array(model.graph.initializer[0]),
                                  "w2": onnx.numpy_helper.to_array(model.graph.initializer[1])})
    reference = ort_session(reference_model)
    expected = _filled([reference.run(["h"], b)[0] for b in batches])
    assert np.array_equal(stats.histograms["h"].counts, expected.counts)
    assert stats.histograms["h"].amax == expected.amax and stats.histograms["h"].count == expected.count
    assert stats.histograms["h"].counts.shape == (2048,)


def test_model_path_with_external_data_gives_the_same_histograms(tmp_path: Any) -> None:
    model = _mlp()
    files = save_onnx(model, tmp_path / "mlp.onnx")
    assert (tmp_path / "mlp.onnx.data") in files
    from_path = collect_histograms(str(tmp_path / "mlp.onnx"), ["h", "r"], _mlp_batches(3))
    from_proto = collect_histograms(model, ["h", "r"], _mlp_batches(3))
    for name in ("h", "r"):
        assert np.array_equal(from_path.histograms[name].counts, from_proto.histograms[name].counts)


def test_graph_inputs_can_be_calibrated_from_the_feed() -> None:
    batches = _mlp_batches(3)
    stats = collect_histograms(_mlp(), ["x"], batches)
    assert stats.histograms["x"].amax == max(float(np.abs(b["x"]).max()) for b in batches)


def test_nan_in_a_batch_names_the_batch_and_tensor() -> None:
    batches = _mlp_batches(4)
    batches[2]["x"][0, 0] = np.nan
    with pytest.raises(CalibrationError, match=r"batch 2: tensor 'h' has \d+ NaN or Inf"):
        collect_histograms(_mlp(), ["h"], batches)


def test_bad_batches_and_names_raise_calibration_errors() -> None:
    with pytest.raises(CalibrationError, match=r"batch 1 has no array for model input\(s\) x;"):
        collect_histograms(_mlp(), ["h"], [_mlp_batches(1)[0], {"images": np.zeros((1, 16), np.float32)}])
    with pytest.raises(CalibrationError, match="batch 0: ONNX Runtime could not run it"):
        collect_histograms(_mlp(), ["h"], [{"x": np.zeros((1, 16), np.float64)}])
    with pytest.raises(CalibrationError, match="'nope' is not in the model"):
        collect_histograms(_mlp(), ["nope"], _mlp_batches(1))
    with pytest.raises(CalibrationError, match="'w1' is a weight"):
        collect_histograms(_mlp(), ["w1"], _mlp_batches(1))
    with pytest.raises(CalibrationError, match="no batches"):
        collect_histograms(_mlp(), ["h"], [])


def _token_model() -> onnx.ModelProto:
    """h = x @ w on [B, S, 4] tokens; the output zeroes padded tokens with the attention mask."""
    w = np.random.default_rng(8).standard_normal((4, 4)).astype(np.float32)
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["m", "last"], ["m3"]),
         helper.make_node("Mul", ["h", "m3"], ["y"])],
        [tensor("x", ["B", "S", 4]), tensor("attention_mask", ["B", "S"], TensorProto.INT64)],
        [tensor("y", ["B", "S", 4])], {"w": w, "last": np.array([-1], np.int64)})


def _padded_batches(lengths: list[list[int]], seq: list[int]) -> list[dict[str, np.ndarray]]:
    """Batches of real tokens ~N(0, 1) followed by padding that holds 1e4 (it must never be counted)."""
    rng = np.random.default_rng(9)
    batches = []
    for real, s in zip(lengths, seq):
        mask = (np.arange(s)[None, :] < np.array(real)[:, None]).astype(np.int64)
        x = np.where(mask[..., None] == 1, rng.standard_normal((len(real), s, 4)), 1e4).astype(np.float32)
        batches.append({"x": x, "attention_mask": mask})
    return batches


def test_variable_sequence_lengths_are_run_as_they_come() -> None:
    seq = [3, 7, 5]
    batches = _padded_batches([[s, s] for s in seq], seq)  # no padding
    stats = collect_histograms(_token_model(), ["h"], batches)
    assert stats.histograms["h"].count == sum(2 * s * 4 for s in seq)
    assert stats.batches == 3 and stats.samples == 6 and stats.excluded == {}


def test_padded_positions_stay_out_of_the_histogram() -> None:
    model = _token_model()
    batches = _padded_batches([[3, 6], [2, 4, 4], [5]], [6, 4, 8])
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    real = np.concatenate([(b["x"] @ w)[b["attention_mask"] == 1].ravel() for b in batches])
    stats = collect_histograms(model, ["h"], batches)
    padded = sum(int((b["attention_mask"] == 0).sum()) * 4 for b in batches)
    assert (stats.histograms["h"].count, stats.excluded["h"]) == (real.size, padded)
    np.testing.assert_allclose(stats.histograms["h"].amax, np.abs(real).max(), rtol=1e-5)
    # FP16 overflow detection counts every value: padding can overflow too.
    assert collect_max_abs(model, ["h"], batches)["h"] > 1e3
    assert collect_max_abs(model, ["h"], batches, exclude_masked=True)["h"] == pytest.approx(np.abs(real).max(),
                                                                                            rel=1e-5)


def _attention_model() -> onnx.ModelProto:
    """scores = x x^T per batch, plus (1 - mask) * -10000 on the keys, then Softmax: BERT's padding mask."""
    return make_model(
        [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
         helper.make_node("MatMul", ["x", "xt"], ["scores"]),
         helper.make_node("Unsqueeze", ["scores", "axis1"], ["scores4"]),
         helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
         helper.make_node("Sub", ["one", "m"], ["inverted"]),
         helper.make_node("Mul", ["inverted", "neg"], ["bias"]),
         helper.make_node("Unsqueeze", ["bias", "axes12"], ["bias4"]),
         helper.make_node("Add", ["scores4", "bias4"], ["biased"]),
         helper.make_node("Softmax", ["biased"], ["probs"], axis=-1)],
        [tensor("x", ["B", "S", 4]), tensor("attention_mask", ["B", "S"], TensorProto.INT64)],
        [tensor("probs", ["B", 1, "S", "S"])],
        {"axis1": np.array([1], np.int64), "axes12": np.array([1, 2], np.int64),
         "one": np.array(1.0, np.float32), "neg": np.array(-10000.0, np.float32)})


def test_mask_biases_and_padded_scores_stay_out() -> None:
    batches = _padded_batches([[3, 5], [4, 2]], [5, 4])
    for b in batches:  # padded tokens give scores of 1e8; keep them finite but far from the real ones
        b["x"][b["attention_mask"] == 0] = 30.0
    unmasked = []
    for b in batches:
        scores = b["x"] @ b["x"].transpose(0, 2, 1)
        real = b["attention_mask"] == 1
        unmasked.append(scores[real[:, :, None] & real[:, None, :]])
    expected = float(np.abs(np.concatenate(unmasked)).max())
    stats = collect_histograms(_attention_model(), ["biased", "bias4"], batches)
    np.testing.assert_allclose(stats.histograms["biased"].amax, expected, rtol=1e-5)
    assert stats.histograms["biased"].count == sum(u.size for u in unmasked)
    # the bias itself keeps only its zeros: one per real key
    assert stats.histograms["bias4"].amax == 0.0
    assert stats.histograms["bias4"].count == sum(int(b["attention_mask"].sum()) for b in batches)
    assert amax_from_histogram(stats.histograms["bias4"], "entropy") == AMAX_FLOOR
    assert collect_max_abs(_attention_model(), ["biased"], batches)["biased"] > 9000.0


def _causal_model() -> onnx.ModelProto:
    """A baked causal mask filled with -1e9 (no mask input), then Softmax, then legit values near -5000."""
    causal = np.tril(np.ones((4, 4), bool))
    return make_model(
        [helper.make_node("Where", ["causal", "x", "fill"], ["biased"]),
         helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
         helper.make_node("MatMul", ["probs", "x"], ["mixed"]),
         helper.make_node("Sub", ["mixed", "offset"], ["shifted"])],
        [tensor("x", ["B", 4, 4])], [tensor("shifted", ["B", 4, 4])],
        {"causal": causal, "fill": np.array(-1e9, np.float32), "offset": np.array(5000.0, np.float32)})


def test_baked_mask_constants_are_excluded_up_to_the_softmax_only() -> None:
    x = np.random.default_rng(10).standard_normal((3, 4, 4)).astype(np.float32)
    stats = collect_histograms(_causal_model(), ["biased", "shifted"], [{"x": x}])
    causal = np.tril(np.ones((4, 4), bool))
    assert stats.histograms["biased"].count == 3 * int(causal.sum())
    assert stats.histograms["biased"].amax == float(np.abs(x[:, causal]).max())
    assert stats.histograms["shifted"].count == x.size  # past the Softmax, values near -5000 are real
    assert stats.histograms["shifted"].amax > 4990.0
    assert collect_max_abs(_causal_model(), ["biased"], [{"x": x}])["biased"] == pytest.approx(1e9)


def test_a_mask_bias_a_subgraph_reads_puts_the_control_flow_output_in_the_cone() -> None:
    then_branch = helper.make_graph([helper.make_node("Add", ["x", "mask_bias"], ["t_out"])], "then", [],
                                    [tensor("t_out", ["B", 4])])
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["e_out"])], "else", [],
                                    [tensor("e_out", ["B", 4])])
    model = make_model([helper.make_node("If", ["cond"], ["scores"], name="if", then_branch=then_branch,
                                         else_branch=else_branch)],
                       [tensor("x", ["B", 4]), tensor("mask_bias", ["B", 4]), tensor("cond", [], TensorProto.BOOL)],
                       [tensor("scores", ["B", 4])])
    x = np.random.default_rng(12).standard_normal((3, 4)).astype(np.float32)
    bias = np.where(np.arange(4) < 3, 0.0, -1e9).astype(np.float32)[None].repeat(3, axis=0)
    stats = collect_histograms(model, ["scores"], [{"x": x, "mask_bias": bias, "cond": np.array(True)}])
    assert stats.histograms["scores"].amax == float(np.abs(x[:, :3]).max())  # the -1e9 biases stay out
    assert stats.histograms["scores"].count == 9


# --- binning on the device (torch), tested on CPU tensors -------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_torch_update_counts_exactly_as_numpy(dtype: type, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(statistics, "_TORCH_UPDATE_CHUNK", 97)  # several chunks per batch, a ragged last one
    rng = np.random.default_rng(11)
    batches = [np.zeros(0), np.zeros(50), rng.standard_normal(300) * 1e-3,  # empty, zeros first, then a range
               rng.standard_normal((7, 40)) * 0.5,  # grows by a factor
               np.array([0.5, -0.5, 0.25]),  # values on bin edges
               rng.standard_normal(1000) * 900.0,  # grows past several factors at once
               np.zeros(13), -np.abs(rng.standard_normal(200)) * 3.0]  # only negatives
    host, device = AbsHistogram(2048), AbsHistogram(2048)
    for batch in batches:
        values = np.asarray(batch, dtype=dtype)
        host.update(values)
        statistics.update_tensors([(device, torch.from_numpy(values))])
        assert np.array_equal(device.counts, host.counts)
        assert (device.upper, device.amax, device.count) == (host.upper, host.amax, host.count)
    assert host.count == sum(np.size(b) for b in batches) and host.upper > 900.0
    edge = AbsHistogram(8)  # a value exactly at the top of the range falls in the last bin, as in numpy
    statistics.update_tensors([(edge, torch.tensor([2.0, 1.0, 0.0]))])
    assert edge.counts.tolist() == [1, 0, 0, 0, 1, 0, 0, 1]
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="NaN or Inf"):
            statistics.update_tensors([(device, torch.tensor([1.0, bad], dtype=torch.float32))])
    assert np.array_equal(device.counts, host.counts)  # a rejected batch leaves the histogram alone


def test_torch_update_of_many_tensors_at_once_counts_as_numpy_does_for_each() -> None:
    """``update_tensors`` over several histograms at once (different bin counts and dtypes, an empty tensor, an
    all-zero one, two batches, the second growing the ranges) leaves each histogram exactly as numpy's ``update``
    of its own values does; a NaN in any one tensor raises before any histogram changes."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    bins = [2048, 16, 2048, 64]
    hosts, devices = [AbsHistogram(n) for n in bins], [AbsHistogram(n) for n in bins]
    for scale in (1.0, 40.0):
        values = [rng.standard_normal(500).astype(np.float32) * scale,
                  (rng.standard_normal((3, 9)) * scale).astype(np.float16), np.zeros(0, np.float32),
                  np.zeros(20, np.float32)]
        for host, v in zip(hosts, values, strict=True):
            host.update(v)
        statistics.update_tensors([(d, torch.from_numpy(v)) for d, v in zip(devices, values, strict=True)])
        for host, device in zip(hosts, devices, strict=True):
            assert np.array_equal(device.counts, host.counts)
            assert (device.upper, device.amax, device.count) == (host.upper, host.amax, host.count)
    before = [d.counts.copy() for d in devices]
    with pytest.raises(ValueError, match="NaN or Inf"):
        statistics.update_tensors([(devices[0], torch.ones(4)), (devices[1], torch.tensor([1.0, float("nan")]))])
    assert all(np.array_equal(d.counts, b) for d, b in zip(devices, before, strict=True))


def _cases() -> dict[str, tuple[onnx.ModelProto, list[str], list[dict[str, np.ndarray]], list[str]]]:
    """(model, tensors, batches, max |x| tensors) covering plain, padded, mask-bias and baked-mask models."""
    padded = _padded_batches([[3, 5], [4, 2]], [5, 4])
    for b in padded:
        b["x"][b["attention_mask"] == 0] = 30.0
    causal = [{"x": np.random.default_rng(10).standard_normal((3, 4, 4)).astype(np.float32)}]
    return {"mlp": (_mlp(), ["h", "r", "x"], _mlp_batches(5), ["y", "h"]),
            "padding": (_token_model(), ["h", "y"], _padded_batches([[3, 6], [2, 4, 4], [5]], [6, 4, 8]), ["h"]),
            "mask bias": (_attention_model(), ["biased", "bias4", "probs"], padded, ["biased"]),
            "baked mask": (_causal_model(), ["biased", "shifted"], causal, [])}


@pytest.mark.parametrize("case", ["mlp", "padding", "mask bias", "baked mask"])
@pytest.mark.parametrize("budget", [1, defaults.CALIB_MEMORY_BUDGET])
def test_the_device_path_gives_the_host_histograms(case: str, budget: int) -> None:
    pytest.importorskip("torch")
    model, names, batches, max_abs = _cases()[case]
    host = collect_histograms(model, names, batches, max_abs_names=max_abs, budget_bytes=budget)
    device = collect_histograms(model, names, batches, max_abs_names=max_abs, device="cpu",
                                device_budget_bytes=budget)
    assert (host.binned_on, device.binned_on) == ("host", "cpu")
    for name in names:
        h, d = host.histograms[name], device.histograms[name]
        assert np.array_equal(d.counts, h.counts), name
        assert (d.upper, d.amax, d.count) == (h.upper, h.amax, h.count), name
    assert (device.batches, device.samples, device.excluded, device.max_abs) == \
        (host.batches, host.samples, host.excluded, host.max_abs)
    assert device.amax("percentile") == host.amax("percentile")


def test_the_device_path_reports_nan_as_the_host_path() -> None:
    pytest.importorskip("torch")
    batches = _mlp_batches(4)
    batches[2]["x"][0, 0] = np.nan
    messages = []
    for device in ("auto", "cpu"):
        with pytest.raises(CalibrationError, match=r"batch 2: tensor 'h' has \d+ NaN or Inf") as err:
            collect_histograms(_mlp(), ["h"], batches, device=device)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_device_runs_are_sized_by_the_device_budget_not_the_host_one() -> None:
    pytest.importorskip("torch")
    batches = [{"x": b["x"]} for b in _mlp_batches(3)]  # 4, 5 and 6 samples
    for device, device_budget, expected in [("auto", None, [1] * 15),  # host: 1 byte -> one sample a run
                                            ("cpu", 1 << 30, [4, 5, 6]),  # device: whole batches
                                            ("cpu", 1, [1] * 15)]:
        slices: list[int] = []
        collect_histograms(_mlp(), ["h"], batches, budget_bytes=1, device=device, device_budget_bytes=device_budget,
                           progress=slices.append)
        assert slices == expected, device


def test_binning_goes_to_cuda_only_with_the_cuda_provider_and_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")

    class Session:
        def __init__(self, provider: str) -> None:
            self.provider = provider

        def get_providers(self) -> list[str]:
            return [self.provider, "CPUExecutionProvider"]

    for torch_cuda, provider, expected in [(True, "CUDAExecutionProvider", "cuda"),
                                           (False, "CUDAExecutionProvider", None),
                                           (True, "CPUExecutionProvider", None)]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda value=torch_cuda: value)
        assert observe._binning_device(Session(provider), "auto") == expected
    assert observe._binning_device(Session("CPUExecutionProvider"), "cpu") == "cpu"
    assert observe._binning_device(Session("CUDAExecutionProvider"), "host") is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 140 << 30))
    assert observe._device_budget("cuda", 64 << 20) == int((80 << 30) * defaults.CALIB_DEVICE_MEMORY_FRACTION)
    assert observe._device_budget("cpu", 64 << 20) == 64 << 20


@pytest.mark.gpu
@pytest.mark.ort_cuda
@pytest.mark.parametrize("case", ["mlp", "padding", "mask bias", "baked mask"])
def test_cuda_binning_gives_the_host_histograms_of_the_same_cuda_runs(case: str) -> None:
    model, names, batches, max_abs = _cases()[case]
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    whole = 1 << 30  # whole batches on both paths: the same ONNX Runtime runs
    host = collect_histograms(model, names, batches, providers=cuda, max_abs_names=max_abs, device="host",
                              budget_bytes=whole)
    gpu = collect_histograms(model, names, batches, providers=cuda, max_abs_names=max_abs, budget_bytes=whole,
                             device_budget_bytes=whole)
    assert (host.binned_on, gpu.binned_on) == ("host", "cuda")
    for name in names:
        assert np.array_equal(gpu.histograms[name].counts, host.histograms[name].counts), name
        assert gpu.histograms[name].amax == host.histograms[name].amax, name
    assert (gpu.excluded, gpu.max_abs) == (host.excluded, host.max_abs)
