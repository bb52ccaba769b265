"""TensorRT's tactic timing caches: the directory's own, the shared ``--timing-cache``, and their keys.

A build directory keeps ``timing.cache`` (this model's tactics) and a shared cache (``--timing-cache``) may
serve many builds; each holds for one TensorRT version and one GPU model (``timing_cache_key``), recorded
beside a shared cache in ``<cache>.key.json``. Reading, checking and combining caches needs TensorRT;
choosing which cache seeds a build does not.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from compiler.backends.tensorrt.logger import tensorrt_logger
from compiler.core.errors import InputError
from compiler.core.files import atomic_write_bytes, atomic_write_text, inside, read_json
from compiler.core.manifest import read_manifest
from compiler.core.settings import BuildSettings

if TYPE_CHECKING:
    import tensorrt as trt
    from typing_extensions import Buffer

__all__ = ["TIMING_CACHE", "TimingCache", "CacheReader", "timing_cache_key", "shared_timing_cache_problem",
           "seed_timing_cache", "tensorrt_cache_reader", "drop_unreadable_timing_cache", "timing_cache_keys",
           "merge_timing_cache"]

log = logging.getLogger(__name__)

TIMING_CACHE = "timing.cache"


def timing_cache_key(env: dict[str, Any]) -> dict[str, Any]:
    """What a timing cache's timings hold for: the TensorRT version and the GPU (name and compute capability).

    TensorRT times tactics per version and device; timings of another GPU model or version are wrong here,
    and a combined cache of several would silently mix them.
    """
    return {"tensorrt": env.get("tensorrt"), "gpu": env.get("gpu"), "compute_capability": env.get("compute_capability")}


def _key_path(cache: Path) -> Path:
    return cache.with_name(cache.name + ".key.json")


def shared_timing_cache_problem(cache: Path, env: dict[str, Any]) -> str | None:
    """Why the shared timing cache ``cache`` (``--timing-cache``) cannot be used by a build in ``env``, or None.

    A new cache (no file yet) is fine. An existing one must carry ``cache.key.json`` with the same
    ``timing_cache_key``: one shared cache per TensorRT version and GPU.
    """
    if not cache.is_file():
        return None
    want = timing_cache_key(env)
    example = cache.with_name(f"trt{want['tensorrt']}-{str(want['gpu']).replace(' ', '_')}.cache")
    fix = f"use one shared cache per TensorRT version and GPU: give --timing-cache another path, e.g. {example}"
    try:
        have = read_json(_key_path(cache))
    except (OSError, ValueError):
        have = None
    if not isinstance(have, dict):
        return (f"--timing-cache {cache}: it does not record which TensorRT and GPU made it "
                f"({_key_path(cache).name}); {fix}")
    if timing_cache_key(have) != want:
        return (f"--timing-cache {cache} holds timings of TensorRT {have.get('tensorrt')} on {have.get('gpu')}, this "
                f"build is TensorRT {want['tensorrt']} on {want['gpu']}; {fix}")
    return None


def seed_timing_cache(directory: Path, stage_cache: Path, settings: BuildSettings, env: dict[str, Any]) -> None:
    """Start STAGE/timing.cache from DIR/timing.cache, else from the shared ``settings.timing_cache``.

    DIR's cache holds this model's tactics and wins; it is skipped when the directory's engines were
    built with another TensorRT or GPU (``timing_cache_key``: TensorRT would not use it). The shared
    cache has been checked by ``shared_timing_cache_problem``; it is only read here, and
    ``build_engine_files`` merges the new timings into it after a successful build.
    """
    stage_cache.unlink(missing_ok=True)  # this policy decides, whatever a caller copied in before
    own = inside(directory, TIMING_CACHE, "timing cache")  # a symlink out of the directory is refused
    if own.is_file():
        try:
            built = dict(read_manifest(directory).environment or {})
        except InputError:  # no manifest, or one that does not read: nothing says where the cache was made
            built = {}
        if timing_cache_key(built) == timing_cache_key(env):
            shutil.copyfile(own, stage_cache)
            return
        log.info("not reusing %s: it was made with TensorRT %s on %s", own, built.get("tensorrt"), built.get("gpu"))
    if settings.timing_cache is not None and settings.timing_cache.is_file():
        shutil.copyfile(settings.timing_cache, stage_cache)


class TimingCache(Protocol):
    """What trtc does with a timing cache that TensorRT has read (``trt.ITimingCache``)."""

    def combine(self, input_cache: Any, ignore_mismatch: bool) -> bool: ...

    def serialize(self) -> Buffer: ...


# reads a timing cache file: the cache, or None where TensorRT cannot read it
CacheReader = Callable[[Path], "TimingCache | None"]


class _TensorRTCacheReader:
    """Reads timing cache files with TensorRT, through one builder config (kept with its builder)."""

    def __init__(self) -> None:
        import tensorrt as trt

        self._builder = trt.Builder(tensorrt_logger())
        self._config = self._builder.create_builder_config()

    def __call__(self, cache: Path) -> trt.ITimingCache | None:
        return _read_timing_cache(self._config, cache)


def tensorrt_cache_reader() -> CacheReader:
    """The ``CacheReader`` that reads with TensorRT. Imports TensorRT."""
    return _TensorRTCacheReader()


def drop_unreadable_timing_cache(cache: Path, read: CacheReader | None = None) -> None:
    """Remove ``cache`` with a warning when TensorRT cannot read it: the build then starts a fresh one.

    ``read``: how to read it (``tensorrt_cache_reader()`` when None, which needs TensorRT).
    """
    if not cache.is_file():
        return
    read = read or tensorrt_cache_reader()
    if read(cache) is None:
        log.warning("the timing cache seeded from the directory or --timing-cache is unreadable; starting a fresh one")
        cache.unlink()


def _read_timing_cache(config: trt.IBuilderConfig, cache: Path) -> trt.ITimingCache | None:
    """The timing cache in file ``cache`` as TensorRT reads it, or None when TensorRT cannot (it raises, or returns
    no cache; why is logged at debug level: the callers warn in their own words)."""
    try:
        return config.create_timing_cache(cache.read_bytes())
    except (RuntimeError, TypeError, ValueError) as err:
        log.debug("timing cache %s: %s", cache, err)
        return None


def timing_cache_keys(cache: Path) -> set[str] | None:
    """The keys of the timings in file ``cache`` (one per layer configuration TensorRT timed), as TensorRT reads
    them; None where it cannot read the file. Imports TensorRT."""
    import tensorrt as trt

    config = trt.Builder(tensorrt_logger()).create_builder_config()
    loaded = _read_timing_cache(config, cache)
    return None if loaded is None else {str(key) for key in loaded.queryKeys()}


def merge_timing_cache(source: Path, target: Path, env: dict[str, Any], read: CacheReader | None = None) -> bool:
    """Fold the timings of ``source`` into the shared timing cache ``target`` made in ``env``, under a file lock.

    ``target`` is created (with its ``.key.json``) if absent; one TensorRT cannot read is a warning and
    replaced by ``source``; one whose key differs is left alone (``shared_timing_cache_problem`` refuses
    it before a build). A ``source`` TensorRT cannot read is a warning and merges nothing. TensorRT
    combines without ignoring mismatches, and a failed combine leaves ``target`` unchanged with a
    warning. Returns whether ``target`` now holds the new timings. ``read``: how cache files are read
    (``tensorrt_cache_reader()`` when None: a timing cache can only be read and combined by TensorRT).
    """
    from polygraphy import util

    read = read or tensorrt_cache_reader()
    cache = read(source)
    if cache is None:
        log.warning("timing cache not merged into %s: TensorRT cannot read this build's %s", target, source)
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with util.LockFile(str(target)):  # target.lock, beside the shared cache: never inside a build directory
        problem = shared_timing_cache_problem(target, env)
        if problem:
            log.warning("timing cache not merged: %s", problem)
            return False
        if target.is_file():
            previous = read(target)
            if previous is None:
                log.warning("%s is unreadable; replacing it with this build's timings", target)
            elif not cache.combine(previous, ignore_mismatch=False):
                log.warning("TensorRT could not combine %s with this build's timings; left it unchanged", target)
                return False
        atomic_write_bytes(target, bytes(memoryview(cache.serialize())))
        atomic_write_text(_key_path(target), json.dumps(timing_cache_key(env), indent=1) + "\n")
    return True
