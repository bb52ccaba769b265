"""The Polygraphy loader chain that builds one engine, constructed without touching TensorRT.

The precision is already in the ONNX graph (Q/DQ pairs and casts), so every network is built
strongly typed and no precision flag is ever set: on TensorRT 10 through the STRONGLY_TYPED
creation flag, on TensorRT 11 because every network is strongly typed. The chain reads like the
pipeline::

    EngineBytesFromNetwork(NetworkFromOnnxPath(onnx, strongly_typed=True),
                           config=PostprocessConfig(CreateConfig(profiles=[...], ...), TensorRTEnumOptions(...)),
                           save_timing_cache=STAGE/timing.cache)

Nothing touches TensorRT, not even to ask its version, until a build step
(``compiler.backends.tensorrt.build_step``) calls the chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.backends.tensorrt.profiles import engine_profile_shapes
from compiler.backends.tensorrt.versions import strongly_typed_flag
from compiler.core.settings import BuildSettings
from compiler.core.specs import ModelSpec

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["StronglyTypedNetworkFromOnnxPath", "TensorRTEnumOptions", "engine_loader"]


@dataclass(frozen=True)
class StronglyTypedNetworkFromOnnxPath:
    """Polygraphy's ``NetworkFromOnnxPath(path, strongly_typed=...)``, made when the build step calls it.

    Whether to ask for the STRONGLY_TYPED flag depends on the TensorRT installed (``strongly_typed_flag``),
    and asking imports TensorRT; so the question waits for the call, and constructing a loader chain never
    touches TensorRT. Called: the (builder, network, parser) that Polygraphy's ``EngineBytesFromNetwork`` takes.
    """

    path: str  # the ONNX file, as Polygraphy's loader keeps it (tensorrt_build_step reads it on a parse failure)

    def __call__(self) -> Any:
        from polygraphy.backend.trt import NetworkFromOnnxPath

        return NetworkFromOnnxPath(self.path, strongly_typed=strongly_typed_flag())()


@dataclass(frozen=True)
class TensorRTEnumOptions:
    """Builder-config options that Polygraphy's ``CreateConfig`` takes as TensorRT enum values.

    Given here as plain values and applied through ``PostprocessConfig`` when the config is created,
    so that the loader chain can be constructed (and inspected) where TensorRT is not installed:
    ``trt.MemoryPoolType.WORKSPACE`` as a dict key would import TensorRT at construction.
    """

    workspace_bytes: int | None = None  # None: TensorRT's default (the device's memory)
    hardware_compat: str = "none"  # settings.HARDWARE_COMPAT_LEVELS: none, same-compute-capability, ampere-plus

    def __call__(self, builder: trt.Builder, network: trt.INetworkDefinition, config: trt.IBuilderConfig) -> None:
        import tensorrt as trt

        if self.workspace_bytes is not None:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace_bytes)
        levels = {"ampere-plus": trt.HardwareCompatibilityLevel.AMPERE_PLUS,
                  "same-compute-capability": trt.HardwareCompatibilityLevel.SAME_COMPUTE_CAPABILITY}
        if self.hardware_compat in levels:
            config.hardware_compatibility_level = levels[self.hardware_compat]


def engine_loader(onnx_path: Path, spec: ModelSpec, buckets_for_this_engine: Sequence[int], settings: BuildSettings,
                  timing_cache_path: Path) -> Any:
    """The Polygraphy loader that builds one engine; constructed only, nothing is built.

    One optimization profile per bucket in ``buckets_for_this_engine`` (one bucket: a single-profile
    engine). The timing cache at ``timing_cache_path`` is loaded before the build when it exists and
    saved (merged into) after it, under Polygraphy's file lock, so the buckets share it. Options from
    ``settings``: workspace limit, builder optimization level 0-5, hardware compatibility level,
    version compatibility and TF32. With version compatibility the lean runtime stays inside the engine
    (``exclude_lean_runtime`` off): a trtc directory is self-contained, and a runtime loading such an
    engine must set ``Runtime.engine_host_code_allowed = True``. TF32 follows ``settings.tf32`` (on by
    default, as in TensorRT and trtexec; Polygraphy alone would turn it off). The ONNX parser keeps its
    default flags (NATIVE_INSTANCENORM is on by default since TensorRT 10, which hardware/version
    compatibility needs). The profiles are ``engine_profile_shapes``, which the manifest records too.
    The network is ``StronglyTypedNetworkFromOnnxPath``: constructing the chain imports no TensorRT.
    """
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, PostprocessConfig, Profile
    from polygraphy.logger import G_LOGGER

    profiles = []
    for shapes in engine_profile_shapes(spec, buckets_for_this_engine, settings.multi_profile):
        profile = Profile()
        for name, (low, opt, high) in shapes.items():
            profile.add(name, min=low, opt=opt, max=high)
        profiles.append(profile)
    load_cache = str(timing_cache_path) if timing_cache_path.is_file() else None
    with G_LOGGER.verbosity(G_LOGGER.WARNING):  # CreateConfig announces at INFO whether TF32 is on
        network = StronglyTypedNetworkFromOnnxPath(str(onnx_path))
        config = CreateConfig(profiles=profiles,
                              tf32=settings.tf32,
                              builder_optimization_level=settings.opt_level,
                              version_compatible=settings.version_compatible or None,
                              load_timing_cache=load_cache)
        options = TensorRTEnumOptions(
            workspace_bytes=settings.workspace_mib << 20 if settings.workspace_mib is not None else None,
            hardware_compat=settings.hardware_compat)
        return EngineBytesFromNetwork(network, config=PostprocessConfig(config, options),
                                      save_timing_cache=str(timing_cache_path))
