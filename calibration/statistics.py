"""Activation statistics for calibration: streaming |x| histograms and the amax each method picks from them.

An ``AbsHistogram`` holds the |x| counts of one tensor in a fixed number of bins, however many batches it is
fed (``calibration/observe.py`` fills them from ONNX Runtime runs). ``amax_from_histogram`` turns a histogram
into a clipping threshold with one of the methods in ``AMAX_METHODS``; ``CalibrationStats`` holds the
histograms of a model's calibrated tensors and how much data went in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler.core import defaults

__all__ = ["AbsHistogram", "update_tensors", "CalibrationStats", "AMAX_METHODS", "amax_from_histogram", "DEFAULT_BINS",
           "AMAX_FLOOR"]

DEFAULT_BINS = 2048  # as TensorRT's and ModelOpt's histogram calibrators
AMAX_FLOOR = 1e-8  # the amax of an all-zero (or never seen) tensor: a scale of 0 would divide by zero
INT8_LEVELS = 127  # positive levels of symmetric signed INT8
ENTROPY_LEVELS = 128  # TensorRT's entropy calibration quantizes the reference distribution to 128 bins
ENTROPY_START_BIN = 128  # and tries thresholds from bin 128 upward
_MSE_CHUNK = 128  # thresholds evaluated at once: a chunk x bins matrix of floats
# Values binned at once by AbsHistogram.update: 128 KiB of float64, reused from malloc's heap batch after batch.
# With 4x larger chunks the peak RSS of a 224x224 CNN's calibration crept up 10% over its first 20 batches.
_UPDATE_CHUNK = 1 << 14
_TORCH_UPDATE_CHUNK = 1 << 24  # values binned at once on the GPU: 128 MiB of float64 and as much int64


class AbsHistogram:
    """A histogram of |x| over [0, ``upper``] in ``num_bins`` equal bins, filled batch by batch.

    The first batch with a non-zero value sets ``upper`` to its max |x|. A later batch whose max exceeds
    ``upper`` widens every bin by the smallest integer factor f that covers it, summing old bins f at a
    time: new bin j is exactly old bins j*f .. j*f+f-1, so earlier counts stay exact and only lose
    resolution. Memory is ``num_bins`` counters however many batches arrive; no raw values are kept.
    ``amax`` is the exact running max |x| and ``count`` the number of values seen.
    """

    def __init__(self, num_bins: int = DEFAULT_BINS) -> None:
        if num_bins < 2:
            raise ValueError(f"an AbsHistogram needs at least 2 bins, got {num_bins}")
        self.num_bins = num_bins
        self.counts = np.zeros(num_bins, dtype=np.int64)
        self.upper = 0.0
        self.amax = 0.0
        self.count = 0

    def __repr__(self) -> str:
        return f"AbsHistogram(num_bins={self.num_bins}, upper={self.upper:.4g}, amax={self.amax:.4g}, " \
               f"count={self.count})"

    @property
    def bin_width(self) -> float:
        return self.upper / self.num_bins

    @property
    def edges(self) -> np.ndarray:
        """The ``num_bins + 1`` bin edges, from 0 to ``upper``."""
        return np.linspace(0.0, self.upper, self.num_bins + 1)

    def update(self, values: np.ndarray) -> None:
        """Count |x| for every element of ``values`` (any shape); raises ValueError on NaN or Inf."""
        flat = np.asarray(values).ravel()
        if flat.size == 0:
            return
        # max and -min rather than max(|x|): no |x| copy of the batch; exact, and NaN propagates through both
        batch_max = self._grow_for(float(np.max(flat)), float(np.min(flat)))
        if self.upper > 0.0:
            scale = self.num_bins / self.upper
            # in float64, a cache-sized chunk at a time: converting a whole batch at once takes four
            # temporaries of 8 bytes a value (200 MB for one 224x224 activation batch) and twice the time
            for start in range(0, flat.size, _UPDATE_CHUNK):
                scaled = np.abs(flat[start:start + _UPDATE_CHUNK], dtype=np.float64)
                scaled *= scale
                index = scaled.astype(np.int64)
                np.minimum(index, self.num_bins - 1, out=index)  # |x| == upper belongs to the last bin
                self.counts += np.bincount(index, minlength=self.num_bins)
        else:
            self.counts[0] += flat.size  # only zeros so far: bin 0 of whatever range comes later
        self.amax = max(self.amax, batch_max)
        self.count += flat.size

    def _grow_for(self, high: float, low: float) -> float:
        """A batch's max |x| from its max and min (NaN and Inf refused), with the range grown to hold it."""
        if not (math.isfinite(high) and math.isfinite(low)):
            raise ValueError("AbsHistogram.update got NaN or Inf values; drop or report them before counting")
        batch_max = max(high, -low)
        if batch_max > self.upper:
            self._grow_to(batch_max)
        return batch_max

    def _grow_to(self, new_max: float) -> None:
        if self.upper == 0.0:
            self.upper = new_max
            return
        factor = math.ceil(new_max / self.upper)
        while self.upper * factor < new_max:  # the division may round down
            factor += 1
        self.counts = _merged_bins(self.counts, factor)
        self.upper *= factor


def _merged_bins(counts: np.ndarray, factor: int) -> np.ndarray:
    """``counts`` with every ``factor`` consecutive bins summed into one, padded back to the same length."""
    merged = np.zeros_like(counts)
    if factor >= counts.size:
        merged[0] = counts.sum()
        return merged
    groups = -(-counts.size // factor)
    padded = np.zeros(groups * factor, dtype=counts.dtype)
    padded[:counts.size] = counts
    merged[:groups] = padded.reshape(groups, factor).sum(axis=1)
    return merged


def _filled_bins(hist: AbsHistogram) -> int:
    """One past the last non-empty bin: thresholds above it clip nothing."""
    nonzero = np.flatnonzero(hist.counts)
    return int(nonzero[-1]) + 1 if nonzero.size else 0


# Each method maps a histogram and the percentile (used by "percentile" only) to an amax; the caller
# clips the result to [AMAX_FLOOR, hist.amax].
def _amax_max(hist: AbsHistogram, percentile: float) -> float:
    return hist.amax


def _quantile_edge(hist: AbsHistogram, percentile: float) -> float:
    """The upper edge of the bin where the cumulative count reaches ``percentile`` % of all values."""
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    cumulative = np.cumsum(hist.counts)
    index = int(np.searchsorted(cumulative, cumulative[-1] * (percentile / 100.0)))
    return (index + 1) * hist.bin_width


def _amax_percentile(hist: AbsHistogram, percentile: float) -> float:
    """The upper edge of the bin where the cumulative count reaches ``percentile`` % of all values, raised
    where clipping there would cost more than it saves.

    A percentile drops the rarest values whatever they are: fine for random spikes, wrong for the few
    systematic outliers of real transformer weights (a [CLS] token's "massive activation" in two channels is
    1 value in 20 000 of a 48-token batch, below the 0.01 % that 99.99 clips, and every token attends to it).
    So the percentile threshold t stands only while the expected squared error of clipping the values above
    t is at most the rounding error INT8 makes below it (the two terms of the ``mse`` method); otherwise t
    moves up to the first bin edge where that holds.
    """
    index = round(_quantile_edge(hist, percentile) / hist.bin_width) - 1 if hist.upper > 0 else 0
    filled = _filled_bins(hist)
    if index + 1 >= filled:
        return (index + 1) * hist.bin_width
    counts = hist.counts[:filled].astype(np.float64)
    edges = np.arange(filled + 1, dtype=np.float64)
    candidates = np.arange(index + 1, filled + 1)
    for chunk in np.array_split(candidates, -(-candidates.size // _MSE_CHUNK)):
        rounding, clipping = _error_terms(counts, edges, chunk)
        fine = np.flatnonzero(clipping <= rounding)
        if fine.size:
            return int(chunk[fine[0]]) * hist.bin_width
    return filled * hist.bin_width


def _amax_entropy(hist: AbsHistogram, percentile: float) -> float:
    """TensorRT's entropy calibration: the threshold whose 128-level quantization loses the least (KL).

    For each candidate of i bins (i >= 128), the reference P is bins[:i] with everything above folded into
    its last bin; Q is bins[:i] merged into 128 levels and spread back evenly over the non-empty bins of
    each level. The largest i of minimal KL(P || Q) wins, as in ModelOpt's ``_compute_amax_entropy``.
    As there, the threshold is never below 1/16 of the histogram's filled range, and Q is not smoothed:
    a candidate whose last bin is empty while values lie above it scores KL = inf, so outliers more than
    16x beyond the bulk leave the max as the only finite choice.
    """
    filled = _filled_bins(hist)
    if filled <= ENTROPY_START_BIN:
        return filled * hist.bin_width  # 128 levels represent this range without loss
    counts = hist.counts[:filled].astype(np.float64)
    counts[0] = counts[1]  # as ModelOpt: the spike of exact zeros (after ReLU) must not decide the threshold
    above = np.append(np.cumsum(counts[::-1])[::-1], 0.0)  # above[i] = counts[i:].sum()
    best_bins, best_kl = filled, math.inf
    for bins in range(ENTROPY_START_BIN, filled + 1):
        kl = _quantization_kl(counts[:bins], above[bins])
        if kl <= best_kl:
            best_bins, best_kl = bins, kl
    return best_bins * hist.bin_width


def _quantization_kl(reference: np.ndarray, clipped: float) -> float:
    levels = (np.arange(reference.size) * ENTROPY_LEVELS) // reference.size
    nonzero = reference > 0
    level_sums = np.bincount(levels, weights=reference, minlength=ENTROPY_LEVELS)
    level_nonzero = np.bincount(levels, weights=nonzero, minlength=ENTROPY_LEVELS)
    q = np.where(nonzero, level_sums[levels] / np.maximum(level_nonzero[levels], 1.0), 0.0)
    p = reference.copy()
    p[-1] += clipped
    support = p > 0
    if q.sum() == 0.0 or np.any(q[support] == 0.0):
        return math.inf  # P has mass where Q has none
    p_s = p[support] / p.sum()
    q_s = q[support] / q.sum()
    return float(np.sum(p_s * np.log(p_s / q_s)))


def _amax_mse(hist: AbsHistogram, percentile: float) -> float:
    """The bin edge t that minimises the expected squared error of INT8 quantization clipped at t.

    Values are taken as spread evenly within each bin. Below t the error is the rounding error to a grid
    of step t/127, integrated exactly over each bin; above t it is the clipping error (x - t)^2. Every
    edge up to the last non-empty bin is a candidate.
    """
    filled = _filled_bins(hist)
    if filled == 0:
        return 0.0
    counts = hist.counts[:filled].astype(np.float64)
    edges = np.arange(filled + 1, dtype=np.float64)  # in bin widths: the unit does not move the argmin
    candidates = np.arange(1, filled + 1)
    errors = np.concatenate([_expected_errors(counts, edges, chunk)
                             for chunk in np.array_split(candidates, -(-filled // _MSE_CHUNK))])
    return (int(np.argmin(errors)) + 1) * hist.bin_width


def _expected_errors(counts: np.ndarray, edges: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """The summed squared error of quantizing the histogram at each threshold (all in bin widths)."""
    rounding, clipping = _error_terms(counts, edges, thresholds)
    return rounding + clipping


def _error_terms(counts: np.ndarray, edges: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rounding error below, clipping error above) each threshold, summed over the histogram, in bin widths."""
    t = thresholds[:, None].astype(np.float64)
    low, high = edges[:-1], edges[1:]
    step = t / INT8_LEVELS
    below = high <= t
    rounding = _rounding_error_integral(high, step) - _rounding_error_integral(low, step)
    clipping = (_cube(high - t) - _cube(low - t)) / 3.0
    return np.where(below, rounding, 0.0) @ counts, np.where(below, 0.0, clipping) @ counts


def _rounding_error_integral(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The integral from 0 to x of (u - step * round(u / step))^2 du; the integrand has period ``step``."""
    periods = np.floor(x / step)
    rest = x - periods * step
    # up to the midpoint u rounds down to 0 (error u^2), past it up to step (error (u - step)^2)
    partial = np.where(rest <= step / 2, _cube(rest) / 3.0, _cube(step) / 12.0 + _cube(rest - step) / 3.0)
    return periods * (_cube(step) / 12.0) + partial


def _cube(x: np.ndarray) -> np.ndarray:
    return x * x * x  # much faster than x ** 3, which goes through pow


AMAX_METHODS: dict[str, Callable[[AbsHistogram, float], float]] = {
    "max": _amax_max,
    "percentile": _amax_percentile,
    "entropy": _amax_entropy,
    "mse": _amax_mse,
}


def amax_from_histogram(hist: AbsHistogram, method: str, percentile: float = defaults.PERCENTILE) -> float:
    """The clipping threshold (amax, in the tensor's units) that ``method`` picks from ``hist``.

    Methods: ``max`` (exact max |x|), ``percentile`` (upper edge of the bin where ``percentile`` % of the
    values is reached, raised where clipping there costs more squared error than INT8 rounding below it),
    ``entropy`` (TensorRT's KL-divergence calibration), ``mse`` (least expected squared INT8 error). The
    result lies in [AMAX_FLOOR, hist.amax]: positive even for an all-zero or empty histogram. Raises
    ValueError for an unknown method or a percentile outside (0, 100].
    """
    if method not in AMAX_METHODS:
        raise ValueError(f"unknown amax method {method!r}; use one of {', '.join(AMAX_METHODS)}")
    amax = AMAX_METHODS[method](hist, percentile)
    return max(min(amax, hist.amax), AMAX_FLOOR)


@dataclass(frozen=True)
class CalibrationStats:
    """The |x| histogram of each calibrated tensor and how much data went in.

    ``samples`` counts the leading (batch) dimension of the first model input over all batches;
    ``excluded`` counts, per tensor, the values left out as padding or mask biases; ``max_abs`` is the
    max |x| of each tensor of ``collect_histograms``' ``max_abs_names`` (None when none were asked for).
    """

    histograms: dict[str, AbsHistogram]
    batches: int
    samples: int
    excluded: dict[str, int] = field(default_factory=dict)
    max_abs: dict[str, float] | None = None
    binned_on: str = "host"  # where the histograms were counted: "host" (numpy) or a torch device ("cuda")
    infinite: dict[str, int] = field(default_factory=dict)  # per tensor: the model's own infinities, left out

    def amax(self, method: str, percentile: float = defaults.PERCENTILE) -> dict[str, float]:
        """``amax_from_histogram`` for every tensor."""
        return {name: amax_from_histogram(hist, method, percentile) for name, hist in self.histograms.items()}


def update_tensors(pairs: Sequence[tuple[AbsHistogram, Any]]) -> None:
    """``AbsHistogram.update`` for torch tensors, each binned where it lives (a CUDA tensor stays on its GPU), every
    pair's kernels queued back to back with two host synchronizations in all: the min and max of every tensor come
    back together, then every tensor's counts. Binned one tensor at a time, the host would wait on the GPU twice per
    tensor (some 200 tensors per batch of a ViT-B/16).

    The same counts as ``update`` on the same values, bit for bit: |x| in float64 times the same float64 scale,
    truncated to a bin index, the top clamped into the last bin; the range grows by the same rule (on the host,
    from the batch's max and min). Raises ValueError on NaN or Inf as ``update``, before any histogram changes.
    Returns once the GPU has finished (the counts are on the host): the caller may free the tensors.
    """
    import torch

    work = [(histogram, values.reshape(-1)) for histogram, values in pairs if values.numel()]
    if not work:
        return
    bounds = torch.stack([torch.stack(torch.aminmax(flat)).to(torch.float64) for _, flat in work]).tolist()
    for low, high in bounds:
        if not (math.isfinite(high) and math.isfinite(low)):
            raise ValueError("AbsHistogram.update got NaN or Inf values; drop or report them before counting")
    binned: list[tuple[AbsHistogram, Any]] = []
    for (histogram, flat), (low, high) in zip(work, bounds, strict=True):
        batch_max = histogram._grow_for(high, low)
        if histogram.upper > 0.0:
            scale = histogram.num_bins / histogram.upper
            counts = torch.zeros(histogram.num_bins, dtype=torch.int64, device=flat.device)
            for start in range(0, flat.numel(), _TORCH_UPDATE_CHUNK):
                scaled = flat[start:start + _TORCH_UPDATE_CHUNK].to(torch.float64).abs_()
                scaled *= scale
                index = scaled.to(torch.int64).clamp_(max=histogram.num_bins - 1)
                counts += torch.bincount(index, minlength=histogram.num_bins)
            binned.append((histogram, counts))
        else:
            histogram.counts[0] += flat.numel()
        histogram.amax = max(histogram.amax, batch_max)
        histogram.count += flat.numel()
    by_device: dict[Any, list[tuple[AbsHistogram, Any]]] = {}
    for histogram, counts in binned:
        by_device.setdefault(counts.device, []).append((histogram, counts))
    for group in by_device.values():
        on_host = torch.cat([counts for _, counts in group]).cpu().numpy()
        at = 0
        for histogram, _ in group:
            histogram.counts += on_host[at:at + histogram.num_bins]
            at += histogram.num_bins
