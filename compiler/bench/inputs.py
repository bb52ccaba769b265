"""The feeds of a bench run: one per bucket, the same bytes for every backend.

From ``--data`` (an .npz), else from the build's evaluation data or, failing that, its calibration
data (as recorded in ``report/accuracy.json``, when the files are still there), else seeded random
normal values; ``bench_inputs`` says which, and ``feed_record`` gives the sha256 bench.json records
for each feed.
"""

from __future__ import annotations

import hashlib
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from compiler.core.errors import InputError
from compiler.core.files import read_json
from compiler.core.manifest import Manifest
from compiler.core.specs import BATCH_DIM, ModelSpec

__all__ = ["bench_inputs", "build_data", "feed_record", "first_line", "input_feeds"]


def input_feeds(spec: ModelSpec, buckets: tuple[int, ...], seed: int = 0, data: Path | None = None,
                ) -> dict[int, dict[str, np.ndarray]]:
    """One feed per bucket: seeded random (``ModelSpec.example_feed``, other dynamic dims at their opt) or
    the first ``bucket`` samples of each array in ``data`` (repeated when it holds fewer)."""
    if data is None:
        return {b: spec.example_feed(b, seed=seed) for b in buckets}
    try:
        with np.load(data) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:  # what np.load raises on damage
        raise InputError(f"--data {data}: not a readable .npz file ({err or err.__class__.__name__})") from err
    missing = [n for n in spec.input_names if n not in arrays]
    if missing:
        raise InputError(f"--data {data} has no array for input(s) {', '.join(missing)} (it has "
                         f"{', '.join(arrays) or 'none'}); save one array per input name")
    feeds: dict[int, dict[str, np.ndarray]] = {}
    for bucket in buckets:
        feed: dict[str, np.ndarray] = {}
        for inp in spec.inputs:
            array = arrays[inp.name]
            if inp.dims and inp.dims[0] == BATCH_DIM:
                if array.ndim != len(inp.dims):
                    raise InputError(f"--data {data}: {inp.name} has shape {array.shape} but the input is {inp}")
                array = array[np.arange(bucket) % len(array)]
            feed[inp.name] = np.ascontiguousarray(array.astype(inp.dtype if inp.dtype != "bfloat16" else "float32"))
        feeds[bucket] = feed
    return feeds


def build_data(directory: Path, manifest: Manifest) -> tuple[Path | None, str]:
    """The build's evaluation data, else its calibration data, when ``report/accuracy.json`` names real files that
    are still there: (path, what it is), or (None, why not). Random data and image folders (they need the
    profile's preprocessing) are not used; ``--data`` takes any .npz."""
    path = directory / "report" / "accuracy.json"
    try:
        reports = read_json(path) if path.is_file() else {}
    except (OSError, ValueError):
        reports = {}
    precision = manifest.precision
    ordered = sorted(reports.items(), key=lambda kv: kv[0] != precision) if isinstance(reports, dict) else []
    why = "the build records no evaluation or calibration data"
    kinds = (("eval_data", "the build's evaluation data"), ("calibration_data", "the build's calibration data"))
    for key, what in kinds:
        for _, report in ordered:
            entry = (report or {}).get(key) if isinstance(report, dict) else None
            if not entry or not entry.get("source"):
                continue
            if entry.get("random"):
                why = "the build was calibrated on random data"
                continue
            source = Path(str(entry["source"]))
            arrays = source.is_file() and source.suffix in (".npz", ".npy")
            if arrays or (source.is_dir() and (any(source.glob("*.npz")) or any(source.glob("*.npy")))):
                return source, f"{what} {source}"
            why = f"{what} {entry['source']} is not here (or is an image folder); pass --data x.npz"
    return None, why


def bench_inputs(target_dir: Path | None, manifest: Manifest, spec: ModelSpec, buckets: tuple[int, ...],
                 seed: int = 0, data: Path | None = None) -> tuple[dict[int, dict[str, np.ndarray]], str]:
    """The feeds every backend gets, and where they came from: ``data``, else the build's evaluation or calibration
    data (``build_data``), else seeded random normal values."""
    if data is not None:
        return input_feeds(spec, buckets, seed, data), f"--data {data}"
    found, why = build_data(target_dir, manifest) if target_dir is not None else (None, "a temporary export")
    if found is not None:
        from calibration.data import calibration_data
        from compiler.core.errors import CalibrationError

        try:
            first = next(calibration_data(found, spec, batch_size=max(buckets), max_samples=max(buckets),
                                          labels=None).batches())
        except (CalibrationError, InputError, OSError, ValueError) as err:
            why = f"{found} does not load ({first_line(err)})"
        else:
            feeds = {b: {n: np.ascontiguousarray(first[n][np.arange(b) % len(first[n])]) for n in spec.input_names}
                     for b in buckets}
            samples = len(next(iter(first.values())))
            return feeds, _data_note(why, samples)
    return input_feeds(spec, buckets, seed), f"random normal, seed {seed} ({why})"


def _data_note(what: str, samples: int) -> str:
    return f"{what} (first {samples} sample(s), repeated to fill a bucket)"


def feed_record(feed: dict[str, np.ndarray]) -> dict[str, Any]:
    """What bench.json records of a feed: the sha256 of its names and bytes, and each tensor's shape and dtype."""
    h = hashlib.sha256()
    for name, array in feed.items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return {"sha256": h.hexdigest(),
            "tensors": {n: {"shape": list(a.shape), "dtype": str(a.dtype)} for n, a in feed.items()}}


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, at most 300 characters ("" when it has none): a reason for the report."""
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else ""
