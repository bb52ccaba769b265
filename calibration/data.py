"""Calibration and evaluation data: read, check against the input spec, batch, fingerprint.

Sources (``--calib-data``):
  * an ``.npz`` file of arrays keyed by input name, or an ``.npy`` file (single-input models);
    each array is a batch (rank of the input) or one sample (rank - 1);
  * a folder of such files, read in name order (sequence models keep each file's own length);
  * a folder of images, preprocessed as the profile's ``[calibration.image]`` says;
  * ``random``: seeded random inputs, for smoke tests only; the manifest and report say so.
``--calib-loader pkg.module:fn`` supplies anything else: an iterable of ``{input_name: array}``.

Data is read lazily, file by file, on every pass, so memory does not grow with the data set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import queue
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from compiler.core import defaults
from compiler.core.errors import CalibrationError, user_code_failure
from compiler.core.settings import CalibrationSettings, ImagePreprocessing
from compiler.core.specs import BATCH_DIM, ModelSpec
from compiler.core.worker import mark_aside

__all__ = ["CalibrationData", "calibration_data", "RANDOM", "IMAGE_SUFFIXES", "checked_up_front", "NEEDS_DATA"]

log = logging.getLogger(__name__)

RANDOM = "random"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".webp")
LABEL_KEYS = ("labels", "label", "targets")
_READ_ERRORS = (ValueError, OSError, EOFError, zipfile.BadZipFile)  # what np.load raises on a damaged file


@dataclass
class CalibrationData:
    """A re-iterable source of checked batches of at most ``batch_size`` samples.

    ``samples`` and ``fingerprint`` are known after the first full pass (``scan``).
    """

    description: str
    spec: ModelSpec
    batch_size: int
    max_samples: int
    read: Callable[[], Iterator[tuple[str, dict[str, np.ndarray]]]] = field(repr=False)  # (where, sample) pairs
    is_random: bool = False
    labels: np.ndarray | None = None
    repeatable: bool = True  # every pass yields the same batches (not promised by a --calib-loader function)
    samples: int = 0
    fingerprint: str = ""

    def scan(self, fingerprint: bool = True) -> CalibrationData:
        """Check every sample once, count them and (unless not ``fingerprint``: a check only) fingerprint the data."""
        h = hashlib.sha256()
        count = 0
        for _, sample in prefetched(self._checked_samples(), "sample"):
            for name in self.spec.input_names if fingerprint else ():
                h.update(name.encode())
                h.update(str(sample[name].shape).encode())
                h.update(np.ascontiguousarray(sample[name]).data)  # the buffer, not a copy of it
            count += 1
        if count == 0:
            raise CalibrationError(f"{self.description}: no samples; give data with at least one sample")
        if count < self.batch_size:
            log.info("note: %s holds %d samples, fewer than --calib-batch %d: batches of %d", self.description, count,
                     self.batch_size, count)
            self.batch_size = count
        self.samples, self.fingerprint = count, h.hexdigest()
        if self.labels is not None and len(self.labels) < count:
            raise CalibrationError(f"{self.description}: {len(self.labels)} labels for {count} samples")
        return self

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """A new pass of ``batches()``: the data are read again, never held in memory."""
        return self.batches()

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        """Batches of up to ``batch_size`` samples; a change of shape (sequence length) starts a new batch. Read one
        batch ahead in a thread (``prefetched``) while the caller runs the current one."""
        return prefetched(self._batches(), "batch")

    def _batches(self) -> Iterator[dict[str, np.ndarray]]:
        batched = {s.name for s in self.spec.inputs if s.dims and s.dims[0] == BATCH_DIM}
        size = self.batch_size if batched else 1  # a model of fixed shapes takes one sample, as it is, per run
        pending: list[dict[str, np.ndarray]] = []
        for _, sample in self._checked_samples():
            if pending and any(pending[0][n].shape != sample[n].shape for n in sample):
                yield _stack(pending, batched)
                pending = []
            pending.append(sample)
            if len(pending) == size:
                yield _stack(pending, batched)
                pending = []
        if pending:
            yield _stack(pending, batched)

    def _checked_samples(self) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
        for count, (where, sample) in enumerate(self.read()):
            if count >= self.max_samples:
                return
            _check_sample(where, sample, self.spec)
            yield where, {n: sample[n] for n in self.spec.input_names}

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.description, "samples": self.samples, "batch_size": self.batch_size,
                "sha256": self.fingerprint, "random": self.is_random}


_T = TypeVar("_T")
_END = object()


def prefetched(items: Iterator[_T], what: str) -> Iterator[_T]:
    """``items`` made one ahead in a thread: the next batch is read (files, images, random values: NumPy and
    Pillow release the GIL) while the caller's ONNX Runtime session, which releases it too, runs the current one.
    On an H200 the 512 random samples of a ViT-B/16 build were drawn three times (scan, histograms, gate), 1 to 2
    s each, with the GPU idle. What ``items`` raises is raised here, at the item where it happened; closing the
    iterator early (a caller that takes one batch) stops the thread after the item it is making and closes
    ``items`` in that thread. One extra batch is held. In a worker, a native crash while an item is made is named
    as reading that ``what`` (``mark_aside``)."""
    box: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
    changed = threading.Condition()
    room = [1]  # items the maker may make before the caller takes one: it is never two items ahead
    stopped = [False]

    def wait_for_room() -> bool:
        with changed:
            changed.wait_for(lambda: room[0] > 0 or stopped[0])
            if stopped[0]:
                return False
            room[0] -= 1
            return True

    def make() -> None:
        try:
            index = 0
            while wait_for_room():
                mark_aside(f"reading {what} {index}")
                item = next(items, _END)
                mark_aside("")
                box.put((item, None))
                index += 1
                if item is _END:
                    return
        except BaseException as err:  # handed to the caller's thread, which raises it
            box.put((None, err))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    maker = threading.Thread(target=make, name="trtc-data-prefetch", daemon=True)
    maker.start()
    try:
        while True:
            item, err = box.get()
            with changed:
                room[0] += 1
                changed.notify()
            if err is not None:
                raise err
            if item is _END:
                return
            yield item
    finally:
        with changed:
            stopped[0] = True
            changed.notify()
        maker.join()


def calibration_data(source: str | Path | None, spec: ModelSpec, *, loader: str | None = None,
                     batch_size: int = defaults.CALIB_BATCH, max_samples: int = defaults.CALIB_SAMPLES,
                     image: ImagePreprocessing | None = None,
                     labels: str | Path | None = None, seed: int = 0, fingerprint: bool = True) -> CalibrationData:
    """Open a data source and check it fully (shapes, dtypes, NaN/Inf, count) before any model runs; without
    ``fingerprint``, a check only (no digest of the data: ``checked_up_front`` leaves that to the calibration)."""
    if batch_size < 1 or max_samples < 1:
        raise CalibrationError("--calib-batch and --calib-samples must be at least 1")
    if loader:
        if source:
            raise CalibrationError("give either --calib-data or --calib-loader, not both")
        return _scan(fingerprint, CalibrationData(f"--calib-loader {loader}", spec, batch_size, max_samples,
                                     lambda: _from_loader(loader, spec), repeatable=False))
    if source is None:
        raise CalibrationError("no calibration data: pass --calib-data PATH (.npz/.npy file or folder, image folder) "
                               "or --calib-loader pkg.module:fn; `--calib-data random` exists for smoke tests only")
    if str(source) == RANDOM:
        log.warning("calibrating on RANDOM data: scales will not fit real inputs; use this for smoke tests only")
        _warn_of_constant_inputs(spec)
        return _scan(fingerprint, CalibrationData("random (smoke test only)", spec, batch_size, max_samples,
                                     lambda: _random_samples(spec, max_samples, seed), is_random=True))
    path = Path(source)
    if not path.exists():
        raise CalibrationError(f"{path}: no such calibration data; check --calib-data")
    files = _data_files(path)
    if files:
        data = CalibrationData(str(path), spec, batch_size, max_samples, lambda: _from_arrays(files, spec))
        data.labels = _labels(files, labels, max_samples)
        return _scan(fingerprint, data)
    images = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if path.is_dir() else []
    if images:
        prep = image or ImagePreprocessing()
        return _scan(fingerprint, CalibrationData(f"{path} ({len(images)} images)", spec, batch_size, max_samples,
                                     lambda: _from_images(images, spec, prep)))
    raise CalibrationError(f"{path}: holds no .npz/.npy files or images; see `trtc calibrate --help` for the formats")


NEEDS_DATA = ("int8", "fp8")  # precisions whose ranges come from data (INT4's AWQ too, by its method)


def checked_up_front(settings: CalibrationSettings, spec: ModelSpec | None, cache: Path | None = None,
                     ) -> CalibrationSettings:
    """Check the calibration and evaluation data of ``settings`` before any model is exported or calibrated.

    Refuses (CalibrationError, one line) a precision that needs data and has none (INT8 and FP8 unless ``cache``,
    a calibration.json to reuse, exists; INT4 with AWQ). With ``spec``, reads every sample of both once and checks
    it as calibration will (names, shapes, dtypes, NaN/Inf in any sample, labels against the count). Returns the
    settings, ``batch_size`` lowered to the samples there are when it is larger (with a note)."""
    has_data = bool(settings.data or settings.loader)
    if settings.calib_cache is not None and not Path(settings.calib_cache).is_file():
        raise CalibrationError(f"--calib-cache {settings.calib_cache}: no such file; give the calibration.json of an "
                               "earlier build, or calibration data")
    if not has_data and settings.precision in NEEDS_DATA and not (cache is not None and cache.is_file()):
        raise CalibrationError(f"--{settings.precision} needs calibration data: pass --calib-data PATH (.npz/.npy file "
                               "or folder, image folder) or --calib-loader pkg.module:fn (`--calib-data random` for "
                               "smoke tests only)")
    if not has_data and settings.precision == "int4" and settings.int4_method == "awq":
        raise CalibrationError("--int4-weights with --int4-method awq needs calibration data (--calib-data or "
                               "--calib-loader) for its activation-aware scales; pass some, or use --int4-method rtn")
    if spec is None:
        return settings
    batch = settings.batch_size
    if has_data:
        count = settings.samples if settings.data == RANDOM else calibration_data(
            settings.data, spec, loader=settings.loader, batch_size=1, max_samples=settings.samples,
            image=settings.image, labels=settings.labels if not settings.eval_data else None,
            fingerprint=False).samples
        if count < batch:
            log.info("note: the calibration data hold %d samples, fewer than --calib-batch %d: batches of %d", count,
                     batch, count)
            batch = count
    if settings.eval_data and settings.eval_data != RANDOM:
        calibration_data(settings.eval_data, spec, batch_size=1, max_samples=1 << 62, image=settings.image,
                         labels=settings.labels, fingerprint=False)
    return settings if batch == settings.batch_size else dataclasses.replace(settings, batch_size=batch)


def _scan(fingerprint: bool, data: CalibrationData) -> CalibrationData:
    return data.scan(fingerprint)


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in (".npz", ".npy"):
            raise CalibrationError(f"{path}: calibration files must be .npz or .npy (or pass a folder of images)")
        return [path]
    return sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))


def _arrays(path: Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    try:
        if path.suffix == ".npy":
            if len(spec.inputs) != 1:
                raise CalibrationError(f"{path}: an .npy file holds one array, but the model has inputs "
                                       f"{spec.input_names}; use .npz files keyed by input name")
            return {spec.input_names[0]: np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except _READ_ERRORS as err:
        raise CalibrationError(f"{path}: not a readable numpy file ({err})") from err


def _sample_rank(spec: Any) -> int:
    """The rank of one sample of an input: its rank less the batch dimension, all of it without one."""
    return len(spec.dims) - (1 if spec.dims and spec.dims[0] == BATCH_DIM else 0)


def _from_arrays(files: list[Path], spec: ModelSpec) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    for path in files:
        arrays = _arrays(path, spec)
        missing = [n for n in spec.input_names if n not in arrays]
        if missing:
            raise CalibrationError(f"{path}: no array for input {missing[0]!r} (it has {', '.join(arrays) or 'none'}); "
                                   "key the arrays by input name")
        first = spec.inputs[0]
        batched = arrays[first.name].ndim == _sample_rank(first) + 1
        count = len(arrays[first.name]) if batched else 1
        for i in range(count):
            yield f"{path.name}[{i}]", {s.name: arrays[s.name][i] if batched else arrays[s.name]
                                        for s in spec.inputs}


def _labels(files: list[Path], labels: str | Path | None, max_samples: int) -> np.ndarray | None:
    if labels is not None and Path(labels).suffix == ".npy":
        if not Path(labels).is_file():
            raise CalibrationError(f"{labels}: no such labels file; check --labels")
        try:
            return np.load(labels, allow_pickle=False)[:max_samples]
        except _READ_ERRORS as err:
            raise CalibrationError(f"{labels}: not a readable numpy file ({err})") from err
    key = str(labels) if labels else None
    parts = []
    for path in files:
        if path.suffix != ".npz":
            continue
        try:
            with np.load(path, allow_pickle=False) as npz:
                names = [key] if key else [k for k in LABEL_KEYS if k in npz.files]
                found = np.atleast_1d(npz[names[0]]) if names and names[0] in npz.files else None
        except _READ_ERRORS as err:
            raise CalibrationError(f"{path}: not a readable numpy file ({err})") from err
        if key and found is None:
            raise CalibrationError(f"{path}: no {key!r} array for the labels")
        if found is not None:
            parts.append(found)
    return np.concatenate(parts)[:max_samples] if parts else None


def _from_loader(spec_text: str, spec: ModelSpec) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    module_name, _, attr = spec_text.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise CalibrationError(f"--calib-loader {spec_text}: cannot load it ({err}); write pkg.module:fn") from err
    for i, item in enumerate(_user_items(fn, spec_text)):
        if not isinstance(item, dict):
            raise CalibrationError(f"--calib-loader {spec_text}: item {i} is a {type(item).__name__}, not a dict of "
                                   "arrays keyed by input name")
        arrays = {k: np.asarray(v) for k, v in item.items()}
        first = spec.inputs[0]
        if first.name in arrays and arrays[first.name].ndim == _sample_rank(first) + 1:
            for j in range(len(arrays[first.name])):
                yield f"loader item {i}[{j}]", {k: v[j] for k, v in arrays.items()}
        else:
            yield f"loader item {i}", arrays


def _user_items(fn: Callable[[], Any], spec_text: str) -> Iterator[Any]:
    """The items of the user's loader function; what it raises, on the call or while iterating, is a
    CalibrationError naming the loader, the exception and the user's frame."""
    try:
        items = iter(fn())
        while True:
            try:
                item = next(items)
            except StopIteration:
                return
            yield item
    except Exception as err:  # the user's code: any exception is theirs to fix
        raise CalibrationError(f"{user_code_failure(f'--calib-loader {spec_text}', err)}; fix the loader "
                               "(--debug shows the whole traceback)") from err


def _warn_of_constant_inputs(spec: ModelSpec) -> None:
    """Warn of integer inputs that random data fills with zeros (no value range given): every sample then feeds the
    same ids, so the calibration and the gate see one input only."""
    for inp in spec.inputs:
        if inp.describe_values() == "zeros":  # an integer input, not a mask, with no range
            log.warning("random data gives integer input %s zeros in every sample (it has no value range), so the "
                        "samples are alike; give its range, e.g. --input %s[0,N) for ids below N", inp.name, inp)


def _random_samples(spec: ModelSpec, count: int, seed: int) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    batched = {s.name for s in spec.inputs if s.dims and s.dims[0] == BATCH_DIM}  # others: a sample is the input
    for i in range(count):
        feed = spec.example_feed(1, seed=seed + i)
        yield f"random[{i}]", {k: v[0] if k in batched else v for k, v in feed.items()}


def _from_images(images: list[Path], spec: ModelSpec, prep: ImagePreprocessing,
                 ) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    try:
        from PIL import Image
    except ImportError as err:
        raise CalibrationError("image folders need Pillow: pip install pillow") from err
    if len(spec.inputs) != 1 and prep.input is None:
        raise CalibrationError("the model has several inputs: set calibration.image.input to the image input")
    target = next(s for s in spec.inputs if s.name == (prep.input or spec.inputs[0].name))
    dims = target.dims[1:]
    if len(dims) != 3:
        raise CalibrationError(f"input {target} is not an image batch (N x C x H x W or N x H x W x C)")
    h, w = (dims[1], dims[2]) if prep.layout == "NCHW" else (dims[0], dims[1])
    channels = dims[0] if prep.layout == "NCHW" else dims[2]
    if prep.crop is None and not (isinstance(h, int) and isinstance(w, int)):
        raise CalibrationError(f"input {target} has dynamic height/width: set calibration.image.crop = [H, W]")
    crop: tuple[int, int] = prep.crop or (int(h), int(w))
    for path in images:
        try:
            img = Image.open(path).convert("RGB" if channels == 3 else "L")
        except OSError as err:
            raise CalibrationError(f"{path}: not a readable image ({err})") from err
        short = prep.size or max(crop)
        scale = short / min(img.size)
        img = img.resize((max(crop[1], round(img.size[0] * scale)), max(crop[0], round(img.size[1] * scale))),
                         Image.Resampling.BILINEAR)
        left, top = (img.size[0] - int(crop[1])) // 2, (img.size[1] - int(crop[0])) // 2
        img = img.crop((left, top, left + int(crop[1]), top + int(crop[0])))
        pixels: np.ndarray = np.asarray(img, dtype=np.float32)
        pixels = pixels[..., None] if pixels.ndim == 2 else pixels
        mean = np.asarray(prep.mean[: pixels.shape[-1]], np.float32)
        std = np.asarray(prep.std[: pixels.shape[-1]], np.float32)
        x = (pixels * np.float32(prep.scale) - mean) / std
        if prep.layout == "NCHW":
            x = x.transpose(2, 0, 1)
        yield path.name, {target.name: np.ascontiguousarray(x, dtype=np.float32)}


def _check_sample(where: str, sample: dict[str, np.ndarray], spec: ModelSpec) -> None:
    for s in spec.inputs:
        if s.name not in sample:
            raise CalibrationError(f"{where}: no value for input {s.name!r} (has {', '.join(sample)}); key the data by "
                                   "input name")
        value = sample[s.name]
        if value.dtype != np.dtype(s.dtype):
            raise CalibrationError(f"{where}: input {s.name!r} is {value.dtype}, the model takes {s.dtype}; "
                                   f"convert it with .astype('{s.dtype}')")
        want = s.dims[1:] if s.dims and s.dims[0] == BATCH_DIM else s.dims
        if value.ndim != len(want):
            raise CalibrationError(f"{where}: input {s.name!r} has shape {value.shape}, expected one sample shaped "
                                   f"{'x'.join(map(str, want))}")
        for axis, (got, dim) in enumerate(zip(value.shape, want)):
            if isinstance(dim, int) and got != dim:
                raise CalibrationError(f"{where}: input {s.name!r} has shape {value.shape}; dimension {axis} must be "
                                       f"{dim}")
            if isinstance(dim, str) and dim in spec.dims and not spec.dims[dim].min <= got <= spec.dims[dim].max:
                raise CalibrationError(f"{where}: input {s.name!r} dimension {dim}={got} is outside its range "
                                       f"{spec.dims[dim]}")
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise CalibrationError(f"{where}: input {s.name!r} holds NaN or Inf; clean or drop that sample")


def _stack(samples: list[dict[str, np.ndarray]], batched: set[str]) -> dict[str, np.ndarray]:
    """One batch of ``samples``: the inputs in ``batched`` (those with a batch dimension) stacked, the others as the
    first sample has them (an input without a batch dimension is whole in every sample)."""
    return {n: np.stack([s[n] for s in samples]) if n in batched else samples[0][n] for n in samples[0]}

