"""The ONNX Runtime probe: calibration batches run with chosen tensors exposed, their values observed.

``collect_histograms`` runs calibration batches through ONNX Runtime with the requested tensors exposed as
extra graph outputs and folds each batch into one fixed-size ``AbsHistogram`` per tensor before the next
batch runs, so memory does not grow with the number of batches. ``collect_max_abs`` runs the same
machinery for the running max |x| only (FP16 overflow detection), reduced inside the graph.

A batch whose exposed tensors would exceed the memory budget runs in slices of fewer samples. With the CUDA
provider the exposed tensors stay on the GPU and are binned there. With ``exclude_masked=True`` (the default
of ``collect_histograms``) padding positions and attention-mask biases stay out of the histograms;
``calibration/masks.py`` says which values those are.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from calibration.masks import (
    DEFAULT_MASK_BIAS_THRESHOLD,
    kept_values,
    log_exclusions,
    log_infinities,
    mask_bias_cone,
    padding_mask,
    padding_mask_inputs,
)
from calibration.max_abs import add_max_abs_reductions, input_max_abs, reduced_max_abs, scalar_max_abs
from calibration.statistics import DEFAULT_BINS, AbsHistogram, CalibrationStats, update_tensors
from compiler.core import defaults
from compiler.core.errors import CalibrationError
from compiler.core.onnx_io import load_onnx, ort_session, weightless_copy
from compiler.core.worker import mark_step

__all__ = ["collect_histograms", "collect_max_abs", "ChannelSamples", "collect_channel_samples"]

log = logging.getLogger(__name__)

# budget_bytes (default defaults.CALIB_MEMORY_BUDGET) bounds the bytes of exposed tensors one ONNX Runtime call may
# hold: a batch with more is computed in slices of fewer samples. Exposed tensors cannot share ONNX Runtime's
# buffers and the outputs of two calls are held at once (one call's being binned while the next computes), so this
# bounds the activation memory at about 2x it. 64 MiB runs ResNet-50 at 224x224 one or two samples at a time
# (benchmarks/calibration_memory.py measures its peak RSS).


def collect_histograms(model: onnx.ModelProto | str | os.PathLike[str], tensor_names: list[str],
                       batches: Iterable[dict[str, np.ndarray]], *, providers: list[str] | None = None,
                       progress: Callable[[int], None] | None = None, num_bins: int = DEFAULT_BINS,
                       exclude_masked: bool = True, mask_bias_threshold: float = DEFAULT_MASK_BIAS_THRESHOLD,
                       budget_bytes: int = defaults.CALIB_MEMORY_BUDGET,
                       max_abs_names: Iterable[str] = (), device: str = "auto",
                       device_budget_bytes: int | None = None) -> CalibrationStats:
    """Run every batch through ONNX Runtime and histogram |x| of each tensor in ``tensor_names``.

    ``model`` is a proto or a path (external data beside it is loaded); it is not modified. Only the
    requested tensors are added as graph outputs. Each batch maps every model input name to an array;
    batches may differ in shape (each sequence its own length). A batch's arrays are dropped once
    counted. A batch whose exposed tensors would exceed ``budget_bytes`` runs in slices of fewer samples
    (measured on the first sample), so memory is bounded whatever the batch size and the model.
    ``progress`` gets the number of samples after each slice. With ``exclude_masked`` (the default),
    padding and mask biases stay out as calibration/masks.py describes. ``max_abs_names``: tensors whose
    max |x| is measured in the same pass, as ``collect_max_abs`` with its defaults measures it (every value
    counted, reduced inside the graph, only scalars per tensor leave ONNX Runtime), into
    ``CalibrationStats.max_abs``: the FP16 remainder of an INT8 model needs no second pass over the data.

    On the GPU: when the InferenceSession computes on ONNX Runtime's CUDA provider and torch sees CUDA
    (``device="auto"`` picks that), the exposed tensors stay on the device (IOBinding, read by torch through
    DLPack), the histograms are binned there (``update_tensors``: the same counts as on the host) and one call
    may hold ``device_budget_bytes`` of them (default: ``defaults.CALIB_DEVICE_MEMORY_FRACTION`` of the
    device's free memory) instead of ``budget_bytes``. ``device="cpu"`` runs that path on host tensors (the
    tests compare it with numpy); ``device="host"`` keeps the host path (numpy) whatever the provider, as
    ``"auto"`` does on a machine without a GPU.
    Infinities the model computes from finite inputs (calibration/masks.py) stay out of the histograms and of
    the max |x|, and are counted per tensor in ``CalibrationStats.infinite``.
    Raises CalibrationError for an unknown tensor, a batch that lacks an input or that ONNX Runtime rejects,
    NaN in a kept value or a max |x| tensor, Inf in a graph output (mask biases aside), or no batches at all.
    """
    histograms = {name: AbsHistogram(num_bins) for name in dict.fromkeys(tensor_names)}
    reduced_names = tuple(dict.fromkeys(max_abs_names))
    maxima = dict.fromkeys(reduced_names, 0.0)
    excluded = dict.fromkeys(histograms, 0)
    infinite: dict[str, int] = {}
    count = samples = 0
    chosen: list[str | None] = []
    # Binning batch n runs on worker threads (numpy releases the GIL) while ONNX Runtime computes batch
    # n+1; each histogram gets its batches in order, and at most two batches are held at once. On a device
    # each slice is binned before the next call starts (update_tensors returns when its kernels are done, so
    # ONNX Runtime may reuse the memory): the GPU bins in milliseconds, there is little to overlap.
    with ThreadPoolExecutor(max_workers=max(1, min(len(histograms), os.cpu_count() or 1))) as pool:
        pending: list[Future[None]] = []
        for observed in _observed_batches(model, list(histograms), batches, providers, exclude_masked,
                                          mask_bias_threshold, budget_bytes, reduced_names, device,
                                          device_budget_bytes, chosen.append):
            for future in pending:
                future.result()
            for name, value in observed.maxima.items():
                maxima[name] = max(maxima[name], value)
            for name in observed.values:
                excluded[name] += observed.excluded[name]
            for name, n in observed.infinite.items():
                infinite[name] = infinite.get(name, 0) + n
            if chosen[0] is None:
                pending = [pool.submit(histograms[name].update, values) for name, values in observed.values.items()]
            else:
                update_tensors([(histograms[name], values) for name, values in observed.values.items()])
                observed.values.clear()  # this slice's device memory goes back before the next call
                observed.ort_values.clear()
            count = observed.batch + 1
            samples += observed.samples
            if progress is not None:
                progress(observed.samples)
        for future in pending:
            future.result()
    log_exclusions(excluded, mask_bias_threshold)
    log_infinities(infinite)
    binned_on = (chosen[0] if chosen else None) or "host"
    log.info("collected |x| histograms of %d tensors from %d batches (%d samples), binned on %s", len(histograms),
             count, samples, binned_on)
    return CalibrationStats(histograms, count, samples, {k: v for k, v in excluded.items() if v},
                            maxima if reduced_names else None, binned_on, {k: v for k, v in infinite.items() if v})


def collect_max_abs(model: onnx.ModelProto | str | os.PathLike[str], tensor_names: list[str],
                    batches: Iterable[dict[str, np.ndarray]], providers: list[str] | None = None, *,
                    progress: Callable[[int], None] | None = None, exclude_masked: bool = False,
                    mask_bias_threshold: float = DEFAULT_MASK_BIAS_THRESHOLD,
                    budget_bytes: int = defaults.CALIB_MEMORY_BUDGET) -> dict[str, float]:
    """The max |x| of each tensor over all batches (0.0 for a tensor that held no value).

    Built for FP16 overflow detection, so by default every value counts, padding and mask biases
    included: a -1e9 bias overflows FP16 as surely as an activation does (a -inf bias gives inf). Pass
    ``exclude_masked=True`` for the same exclusions as ``collect_histograms``. Raises as it does.
    Without exclusions the max |x| is reduced inside the graph (``add_max_abs_reductions``), as
    ``collect_histograms``' ``max_abs_names`` are: only a few numbers per tensor leave ONNX Runtime, which
    keeps reusing its buffers, so memory is that of plain inference however many tensors are measured,
    and each batch runs whole (``budget_bytes`` then does not apply). ``progress`` gets the number of
    samples after each ONNX Runtime call. The model's own infinities (calibration/masks.py) are left out of the
    max: FP16 stores an infinity as it is.
    """
    names = list(dict.fromkeys(tensor_names))
    maxima = dict.fromkeys(names, 0.0)
    infinite: dict[str, int] = {}
    exposed, reduced = (names, ()) if exclude_masked else ([], tuple(names))
    for observed in _observed_batches(model, exposed, batches, providers, exclude_masked, mask_bias_threshold,
                                      budget_bytes, reduced):
        for name, value in observed.maxima.items():
            maxima[name] = max(maxima[name], value)
        for name, values in observed.values.items():
            if values.size:  # max and -min: no |x| copy of the tensor
                maxima[name] = max(maxima[name], float(values.max()), -float(values.min()))
        for name, n in observed.infinite.items():
            infinite[name] = infinite.get(name, 0) + n
        if progress is not None:
            progress(observed.samples)
    log_infinities(infinite)
    return maxima


@dataclass
class ChannelSamples:
    """Per input channel (the last axis) of one tensor: the mean |x| over every kept row, a uniform sample of at
    most ``collect_channel_samples``' ``rows`` rows (float32), and how many rows there were."""

    mean_abs: np.ndarray
    rows: np.ndarray
    count: int


def collect_channel_samples(model: onnx.ModelProto | str | os.PathLike[str], channels: dict[str, int],
                            batches: Iterable[dict[str, np.ndarray]], *, rows: int = defaults.AWQ_ROWS,
                            providers: list[str] | None = None, budget_bytes: int = defaults.CALIB_MEMORY_BUDGET,
                            progress: Callable[[int], None] | None = None, seed: int = 0) -> dict[str, ChannelSamples]:
    """For each tensor of ``channels`` (name -> channels of its last axis): the mean |x| per channel and a uniform
    sample of ``rows`` rows (reservoir sampling, seeded), over the calibration ``batches``; what AWQ needs.

    Runs as ``collect_histograms`` does (slices within ``budget_bytes``, padding left out as calibration/masks.py
    says), so memory is one slice of the tensors plus ``rows x channels`` floats per tensor, whatever the data.
    Raises as ``collect_histograms``.
    """
    rng = np.random.default_rng(seed)
    sums = {name: np.zeros(width, dtype=np.float64) for name, width in channels.items()}
    kept = {name: np.zeros((0, width), dtype=np.float32) for name, width in channels.items()}
    seen = dict.fromkeys(channels, 0)
    for observed in _observed_batches(model, list(channels), batches, providers, True, DEFAULT_MASK_BIAS_THRESHOLD,
                                      budget_bytes):
        for name, values in observed.values.items():
            block = np.asarray(values, dtype=np.float32).reshape(-1, channels[name])
            sums[name] += np.abs(block).sum(axis=0, dtype=np.float64)
            room = max(0, rows - len(kept[name]))
            if room:
                kept[name] = np.concatenate([kept[name], block[:room]])
            rest = block[room:]
            if len(rest):  # each later row replaces a kept one with probability rows / rows seen so far
                index = rng.integers(0, seen[name] + room + np.arange(1, len(rest) + 1))
                hit = index < rows
                kept[name][index[hit]] = rest[hit]
            seen[name] += len(block)
        if progress is not None:
            progress(observed.samples)
    return {name: ChannelSamples(sums[name] / max(1, seen[name]), kept[name], seen[name]) for name in channels}


@dataclass(frozen=True)
class _Probe:
    """The model with the requested tensors exposed, and what the masking rules need to know about it."""

    model: onnx.ModelProto
    inputs: tuple[str, ...]  # graph inputs a batch must feed
    requested: tuple[str, ...]
    fetched: tuple[str, ...]  # requested tensors that nodes compute (the rest are inputs, read from the feed)
    padding_masks: tuple[str, ...]
    bias_cone: frozenset[str]
    weights_dir: Path | None = None  # loaded from a file without its external weights, which stay there
    max_abs_names: tuple[str, ...] = ()  # tensors whose max |x| (all values) is measured too
    # of those computed by nodes: the in-graph scalar outputs (``add_max_abs_reductions``: bounds, or exact)
    reduced: dict[str, tuple[str, ...]] = field(default_factory=dict)
    outputs: frozenset[str] = frozenset()  # the model's own graph outputs

    @property
    def reduced_outputs(self) -> list[str]:
        """The graph outputs the in-graph reductions added, in the order a call returns them."""
        return [o for outs in self.reduced.values() for o in outs if o]


@dataclass(frozen=True)
class _Observed:
    samples: int
    values: dict[str, np.ndarray]  # kept values of each requested tensor, flattened
    excluded: dict[str, int]
    nbytes: int = 0  # of the exposed tensors ONNX Runtime returned
    batch: int = 0  # index of the batch this slice belongs to
    maxima: dict[str, float] = field(default_factory=dict)  # max |x| of each of the probe's max_abs_names
    # On the device path: the OrtValues whose memory ``values`` (torch tensors, through DLPack) share; held
    # until the histograms have read them.
    ort_values: list[Any] = field(default_factory=list)
    infinite: dict[str, int] = field(default_factory=dict)  # the model's own infinities left out, per tensor
    # tensors whose bounds are not finite in this batch: nothing else is read, and the batch is observed again
    # with their exact reductions (``add_max_abs_reductions``)
    inexact: frozenset[str] = frozenset()


def _observed_batches(model: onnx.ModelProto | str | os.PathLike[str], names: list[str],
                      batches: Iterable[dict[str, np.ndarray]], providers: list[str] | None,
                      exclude_masked: bool, threshold: float, budget_bytes: int = defaults.CALIB_MEMORY_BUDGET,
                      max_abs_names: tuple[str, ...] = (), device: str = "host",
                      device_budget_bytes: int | None = None,
                      on_device: Callable[[str | None], None] | None = None) -> Iterator[_Observed]:
    """The kept values of each batch (in slices within the budget). ``device``: as ``collect_histograms``;
    ``on_device`` is told the device chosen (None: the host path) once the InferenceSession exists."""
    if threshold <= 0:
        raise ValueError(f"mask_bias_threshold must be positive, got {threshold}")
    probe = _probe_for(model, names, threshold, max_abs_names)
    exact: set[str] = set()  # tensors reduced exactly from the first batch where their bounds are not finite
    seen = 0
    per_sample = 0  # bytes of exposed tensors per sample, from the first slice's outputs
    # The budget bounds the exposed tensors; in-graph reductions return scalars, so a probe that
    # exposes nothing runs every batch whole (and without an InferenceSession when it has no reduction either).
    sliced = bool(probe.fetched)
    session = _session_for(probe, providers, in_node_order=bool(probe.reduced)) \
        if probe.fetched or probe.reduced else None
    on = _binning_device(session, device) if session is not None else None
    if on is not None:
        budget_bytes = device_budget_bytes if device_budget_bytes is not None else _device_budget(on, budget_bytes)
        log.info("exposed tensors stay on %s (IOBinding, read by torch through DLPack) and are binned there; "
                 "calls hold at most %.0f MiB of them", on, budget_bytes / 2**20)
    if on_device is not None:
        on_device(on)
    skeleton = weightless_copy(probe.model) if sliced else None
    del probe.model.graph.initializer[:]  # a copy: the InferenceSession has the weights, one copy is enough
    for index, batch in enumerate(batches):
        start, size = 0, _batch_size(batch, probe.inputs)
        if skeleton is not None and not per_sample and size:
            per_sample = _bytes_per_sample(skeleton, probe, batch)
        while start < size or (size == 0 and start == 0):
            if not sliced:
                step = max(1, size)
            else:
                step = 1 if not per_sample else max(1, budget_bytes // per_sample)
            part = _slice(batch, probe.inputs, start, step, size)
            mark_step(f"batch {index}" + (f", samples {start}-{min(size, start + step) - 1}" if size > 1 else ""))
            observed = _observe(session, probe, index, part, exclude_masked, threshold, on)
            if observed.inexact:  # an infinity or a NaN in some tensor: it is reduced exactly from here on
                exact |= observed.inexact
                log.debug("max |x| of %d tensor(s) reduced exactly from batch %d on (%s): their bounds are not "
                          "finite", len(observed.inexact), index, ", ".join(sorted(observed.inexact)[:3]))
                session = None  # its memory goes back before the next session loads the weights
                probe = _probe_for(model, names, threshold, max_abs_names, exact)
                session = _session_for(probe, providers, in_node_order=True)
                del probe.model.graph.initializer[:]
                observed = _observe(session, probe, index, part, exclude_masked, threshold, on)
            if sliced and not per_sample and observed.samples:
                per_sample = max(1, observed.nbytes // observed.samples)
                log.debug("%d bytes of exposed tensors per sample: %d samples per call", per_sample,
                          max(1, budget_bytes // per_sample))
            yield observed
            start += step
            if size == 0:
                break
        seen += 1
    if not seen:
        raise CalibrationError("the calibration data gave no batches; pass at least one batch of inputs")


def _bytes_per_sample(skeleton: onnx.ModelProto, probe: _Probe, batch: dict[str, np.ndarray]) -> int:
    """Bytes of the exposed tensors for one sample shaped like ``batch``'s, from shape inference; 0 if unknown."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(skeleton)
    for vi in fixed.graph.input:
        if vi.name in probe.inputs and vi.name in batch and np.ndim(batch[vi.name]):
            shape = (1, *np.shape(batch[vi.name])[1:])
            vi.type.tensor_type.shape.Clear()
            for d in shape:
                vi.type.tensor_type.shape.dim.add().dim_value = int(d)
    try:
        typed = onnx.shape_inference.infer_shapes(fixed, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError):
        return 0
    infos = {vi.name: vi.type.tensor_type for vi in [*typed.graph.value_info, *typed.graph.output]}
    total = 0
    for name in probe.fetched:
        info = infos.get(name)
        if info is None or not info.HasField("shape") or not all(d.HasField("dim_value") for d in info.shape.dim):
            return 0
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(info.elem_type)).itemsize
        total += math.prod(d.dim_value for d in info.shape.dim) * itemsize
    return total


def _batch_size(batch: dict[str, np.ndarray], inputs: tuple[str, ...]) -> int:
    """The shared leading dimension of the batch's inputs (0 when they do not share one: run it whole)."""
    sizes = {np.shape(batch[name])[0] if np.ndim(batch[name]) else -1 for name in inputs if name in batch}
    return sizes.pop() if len(sizes) == 1 and -1 not in sizes else 0


def _slice(batch: dict[str, np.ndarray], inputs: tuple[str, ...], start: int, step: int,
           size: int) -> dict[str, np.ndarray]:
    if size == 0 or (start == 0 and step >= size):
        return batch
    return {name: (value[start:start + step] if name in inputs else value) for name, value in batch.items()}


def _probe_for(model: onnx.ModelProto | str | os.PathLike[str], names: list[str], threshold: float,
               max_abs_names: tuple[str, ...] = (), exact: set[str] | None = None) -> _Probe:
    weights_dir = None
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    else:  # the weights stay in their file: ONNX Runtime reads them once, no copy is held here
        weights_dir = Path(model).parent
        model = load_onnx(model, load_weights=False)
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    inputs = tuple(i.name for i in graph.input if i.name not in weights)
    outputs = frozenset(o.name for o in graph.output)
    computed = {out for node in graph.node for out in node.output if out}
    for name in dict.fromkeys([*names, *max_abs_names]):
        if name in weights:
            raise CalibrationError(f"tensor {name!r} is a weight (initializer), not an activation: weights are "
                                   "quantized from their values; calibrate only activations")
        if name not in computed and name not in inputs:
            raise CalibrationError(f"tensor {name!r} is not in the model: pass names of graph inputs or node "
                                   "outputs")
    fetched = tuple(name for name in names if name in computed)
    _expose(model, fetched)
    reduced: dict[str, tuple[str, ...]] = {}
    if max_abs_names:
        to_reduce = [name for name in max_abs_names if name in computed]
        types = _element_types(model, to_reduce)
        if not fetched:  # only the scalars leave ONNX Runtime, not the model's own outputs
            del graph.output[:]
        reduced = add_max_abs_reductions(graph, to_reduce, types, exact or ())
    padding_masks = padding_mask_inputs(graph, inputs)
    cone = mask_bias_cone(graph, inputs, threshold, weights_dir)
    return _Probe(model, inputs, tuple(names), fetched, padding_masks, cone, weights_dir, tuple(max_abs_names),
                  reduced, outputs)


def _expose(model: onnx.ModelProto, names: tuple[str, ...]) -> None:
    """Add ``names`` to the graph outputs (element type from shape inference, no shape)."""
    present = {o.name for o in model.graph.output}
    missing = [name for name in names if name not in present]
    if not missing:
        return
    types = _element_types(model, missing)
    model.graph.output.extend(helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT), None)
                              for name in missing)


def _element_types(model: onnx.ModelProto, names: list[str]) -> dict[str, int]:
    """Element types of ``names`` from the graph's value_info and outputs, else from shape inference."""
    infos = [*model.graph.value_info, *model.graph.output]
    if not set(names) <= {i.name for i in infos}:
        try:
            infos = [*onnx.shape_inference.infer_shapes(weightless_copy(model)).graph.value_info,
                     *model.graph.output]
        except (onnx.shape_inference.InferenceError, ValueError) as err:
            log.warning("shape inference failed (%s); exposing calibrated tensors as float32", err)
    return {i.name: i.type.tensor_type.elem_type for i in infos if i.type.tensor_type.elem_type}


def _session_for(probe: _Probe, providers: list[str] | None, in_node_order: bool = False) -> Any:
    """An ONNX Runtime InferenceSession of the probe's model: its graph alone where its weights stay in their files
    (``weights_dir``); ``ort_session`` reads a proto holding large weights from files of its own."""
    return ort_session(probe.model, providers, weights_dir=probe.weights_dir, memory_arena=False,
                       in_node_order=in_node_order)


def _ort_errors() -> tuple[type[Exception], ...]:
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return (state.Fail, state.InvalidArgument, state.RuntimeException, state.EPFail)


def _observe(session: Any, probe: _Probe, index: int, batch: dict[str, np.ndarray], exclude_masked: bool,
             threshold: float, device: str | None = None) -> _Observed:
    missing = [name for name in probe.inputs if name not in batch]
    if missing:
        raise CalibrationError(f"batch {index} has no array for model input(s) {', '.join(missing)}; every batch "
                               f"must map each input name ({', '.join(probe.inputs)}) to an array")
    feed = {name: np.asarray(batch[name]) for name in probe.inputs}
    outputs = [*probe.fetched, *probe.reduced_outputs]
    ort_values: list[Any] = []
    try:
        if not outputs:
            results = []
        elif device is None:
            results = session.run(outputs, feed)
        else:
            results, ort_values = _run_on_device(session, feed, probe, device)
    except _ort_errors() as err:
        raise CalibrationError(f"batch {index}: ONNX Runtime could not run it ({err}); check the batch's "
                               "dtypes and shapes against the model inputs") from err
    arrays = results[:len(probe.fetched)]
    tensors = dict(zip(probe.fetched, arrays))
    got = dict(zip(probe.reduced_outputs, results[len(probe.fetched):]))
    scalars = {name: reduced_max_abs(tuple(float(got[o]) if o else 0.0 for o in outs))
               for name, outs in probe.reduced.items()}
    inexact = frozenset(name for name, pair in scalars.items() if pair is None)
    if inexact:
        return _Observed(0, {}, {}, inexact=inexact)
    mask: Any = padding_mask(feed, probe.padding_masks) if exclude_masked else None
    if device is not None and mask is not None:
        mask = _on_device(mask, device)
    values: dict[str, Any] = {}
    excluded: dict[str, int] = {}
    infinite: dict[str, int] = {}
    for name in probe.requested:
        if name in tensors:
            array = tensors[name] if device is not None else np.asarray(tensors[name])
        else:  # a graph input, read from the feed
            array = feed[name] if device is None else _on_device(feed[name], device)
        values[name], inf = kept_values(index, name, array, mask, name in probe.bias_cone, exclude_masked, threshold,
                                        name in probe.outputs)
        excluded[name] = _numel(array) - _numel(values[name]) - inf
        if inf:
            infinite[name] = inf
    maxima: dict[str, float] = {}
    for name in probe.max_abs_names:
        in_cone = name in probe.bias_cone
        if name in scalars:
            pair = scalars[name]
            assert pair is not None
            maxima[name], inf = scalar_max_abs(index, name, *pair, in_cone, name in probe.outputs)
            if inf:  # a tensor both binned and reduced: the same values, counted once
                infinite[name] = max(infinite.get(name, 0), inf)
        else:
            maxima[name] = input_max_abs(index, name, feed[name], in_cone, threshold)
    first = feed[probe.inputs[0]] if probe.inputs else np.zeros(())
    return _Observed(int(first.shape[0]) if first.ndim else 1, values, excluded, sum(_nbytes(a) for a in arrays),
                     index, maxima, ort_values, infinite)


def _binning_device(session: Any, requested: str) -> str | None:
    """Where the exposed tensors are binned, as a torch device, or None for numpy on the host: for "auto", "cuda"
    when the InferenceSession computes on ONNX Runtime's CUDA provider and torch sees a CUDA device, else None."""
    if requested == "host":
        return None
    if requested != "auto":
        return requested
    if session.get_providers()[0] != "CUDAExecutionProvider":
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        log.warning("ONNX Runtime runs calibration on CUDA but torch sees no CUDA device: binning on the host")
        return None
    return "cuda"


def _device_budget(device: str, host_budget: int) -> int:
    """Bytes of exposed tensors one call may keep on ``device``: a fraction of its free memory (the host budget on
    "cpu", where the torch path runs only to be tested against numpy)."""
    if device == "cpu":
        return host_budget
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return max(host_budget, int(free * defaults.CALIB_DEVICE_MEMORY_FRACTION))


def _run_on_device(session: Any, feed: dict[str, np.ndarray], probe: _Probe, device: str,
                   ) -> tuple[list[Any], list[Any]]:
    """One call with the exposed tensors bound on ``device`` ("cuda", or "cpu" for tests): (results, OrtValues).

    The results are torch tensors sharing the OrtValues' memory (DLPack, no copy), then the in-graph max |x|
    scalars as numpy (bound on the host: one number each). ONNX Runtime has finished the call when it returns
    (it synchronizes its stream at the end of a call by default), so torch may read the tensors on any stream.
    """
    import torch

    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_cpu_input(name, np.ascontiguousarray(array))
    kind = torch.device(device)
    for name in probe.fetched:
        binding.bind_output(name, kind.type, kind.index or 0)
    for name in probe.reduced_outputs:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    ort_values = list(binding.get_outputs())
    fetched = len(probe.fetched)
    results = [torch.from_dlpack(v) for v in ort_values[:fetched]] + [v.numpy() for v in ort_values[fetched:]]
    return results, ort_values


def _on_device(array: np.ndarray, device: str) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _numel(values: Any) -> int:
    """Elements of a numpy array or a torch tensor (whose ``size`` is a method)."""
    return int(values.size) if isinstance(values, np.ndarray) else int(values.numel())


def _nbytes(values: Any) -> int:
    return int(values.nbytes) if isinstance(values, np.ndarray) else int(values.numel() * values.element_size())
