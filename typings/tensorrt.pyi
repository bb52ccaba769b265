# Type stub for exactly the TensorRT Python API that trtc calls (compiler/backends/tensorrt/), nothing more.
#
# Checked against the TensorRT 11.4 bindings (the tensorrt_cu12_bindings 11.4.0.106 wheel from PyPI): its module
# does not import without TensorRT's libraries, so each name, parameter name and type below was read from the
# extension file's pybind signatures and docstrings (`strings tensorrt_bindings/tensorrt.so`), and each is also in
# TensorRT 10.13 with the same parameter names (compared with tensorrt-stubs 10.13, generated from its bindings).
# What TensorRT 11 removed (EXPLICIT_BATCH, the FP16/INT8 builder flags, precision constraints, INT8 calibrators)
# is in neither the 11.4 bindings nor this stub.
# tests/compiler/backends/tensorrt/test_acceptance.py::test_the_type_stub_matches_the_installed_tensorrt checks it against a real
# TensorRT on a machine that has one.
#
# This is a single .pyi file, never a folder: nothing can import it, so `import tensorrt` stays honest where TensorRT
# is not installed (a `tensorrt/` folder would import as a namespace package). mypy finds it through
# pyproject.toml's mypy_path. A name trtc starts to use must be added here, checked against the bindings the same way.

from collections.abc import Sequence
from typing import ClassVar, SupportsIndex

from typing_extensions import Buffer

__version__: str

class _Enum:
    # typing only, not a TensorRT name: what every value of a pybind enum has
    @property
    def name(self) -> str: ...
    def __int__(self) -> int: ...

# --- logging ---------------------------------------------------------------------------------------------------

class ILogger:
    # trtc creates no logger: it passes Polygraphy's (polygraphy.backend.trt.util.get_trt_logger, an ILogger)
    ...

# --- enums -------------------------------------------------------------------------------------------------------

class DataType(_Enum):
    FLOAT: ClassVar[DataType]
    HALF: ClassVar[DataType]
    BF16: ClassVar[DataType]
    INT8: ClassVar[DataType]
    INT32: ClassVar[DataType]
    INT64: ClassVar[DataType]
    BOOL: ClassVar[DataType]
    UINT8: ClassVar[DataType]

class TensorIOMode(_Enum):
    INPUT: ClassVar[TensorIOMode]
    OUTPUT: ClassVar[TensorIOMode]

class NetworkDefinitionCreationFlag(_Enum):
    # deprecated in TensorRT 11 (every network is strongly typed) but still defined in 11.4
    STRONGLY_TYPED: ClassVar[NetworkDefinitionCreationFlag]

class MemoryPoolType(_Enum):
    WORKSPACE: ClassVar[MemoryPoolType]

class HardwareCompatibilityLevel(_Enum):
    AMPERE_PLUS: ClassVar[HardwareCompatibilityLevel]
    SAME_COMPUTE_CAPABILITY: ClassVar[HardwareCompatibilityLevel]

class ExecutionContextAllocationStrategy(_Enum):
    USER_MANAGED: ClassVar[ExecutionContextAllocationStrategy]

class LayerInformationFormat(_Enum):
    JSON: ClassVar[LayerInformationFormat]

class ErrorCode(_Enum): ...

# --- values ------------------------------------------------------------------------------------------------------

class Dims:
    def __len__(self) -> int: ...
    def __getitem__(self, index: SupportsIndex) -> int: ...

class IHostMemory:
    # the bindings give it the buffer protocol (bytes(memory), memoryview(memory))
    def __buffer__(self, flags: int, /) -> memoryview: ...

# --- building ----------------------------------------------------------------------------------------------------

class INetworkDefinition: ...

class TimingCacheKey:
    def __str__(self) -> str: ...

class ITimingCache:
    def combine(self, input_cache: ITimingCache, ignore_mismatch: bool) -> bool: ...
    def serialize(self) -> IHostMemory: ...
    def queryKeys(self) -> list[TimingCacheKey]: ...

class IBuilderConfig:
    hardware_compatibility_level: HardwareCompatibilityLevel
    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None: ...
    # None where TensorRT cannot read the bytes (the C++ call returns a null pointer)
    def create_timing_cache(self, serialized_timing_cache: Buffer) -> ITimingCache | None: ...

class Builder:
    def __init__(self, logger: ILogger) -> None: ...
    def create_builder_config(self) -> IBuilderConfig: ...
    def create_network(self, flags: int = 0) -> INetworkDefinition: ...

class ParserError:
    def code(self) -> ErrorCode: ...
    def desc(self) -> str: ...
    def node(self) -> int: ...
    def node_name(self) -> str: ...
    def node_operator(self) -> str: ...
    def local_function_stack(self) -> list[str]: ...

class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: ILogger) -> None: ...
    @property
    def num_errors(self) -> int: ...
    def get_error(self, index: int) -> ParserError: ...
    def parse_from_file(self, model: str) -> bool: ...

# --- running -----------------------------------------------------------------------------------------------------

class IExecutionContext:
    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool: ...
    def set_input_shape(self, name: str, shape: Sequence[int] | Dims) -> bool: ...
    def get_tensor_shape(self, name: str) -> Dims: ...
    def set_tensor_address(self, name: str, memory: int) -> bool: ...
    def set_device_memory(self, memory: int, size: int) -> None: ...
    def execute_async_v3(self, stream_handle: int) -> bool: ...

class EngineInspector:
    # the context whose shapes the inspector reports: the bindings keep no reference to it, so trtc deletes the
    # inspector before the context (compiler/backends/tensorrt/layers.py)
    execution_context: IExecutionContext
    def get_engine_information(self, format: LayerInformationFormat) -> str: ...

class ICudaEngine:
    @property
    def num_io_tensors(self) -> int: ...
    @property
    def num_optimization_profiles(self) -> int: ...
    def get_tensor_name(self, index: int) -> str: ...
    def get_tensor_mode(self, name: str) -> TensorIOMode: ...
    def get_tensor_dtype(self, name: str) -> DataType: ...
    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int: ...
    # None where TensorRT cannot make one (out of device memory)
    def create_execution_context(
        self, strategy: ExecutionContextAllocationStrategy = ...) -> IExecutionContext | None: ...
    def create_engine_inspector(self) -> EngineInspector: ...

class Runtime:
    engine_host_code_allowed: bool
    def __init__(self, logger: ILogger) -> None: ...
    # None where TensorRT cannot load the bytes (another version, corrupt, host code not allowed)
    def deserialize_cuda_engine(self, serialized_engine: Buffer) -> ICudaEngine | None: ...
