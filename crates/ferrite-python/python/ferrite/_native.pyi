# Hand-kept stubs for the compiled module; checked by `python -m mypy.stubtest ferrite._native`.
from typing import Any, Dict, List, Optional, Tuple, final

import numpy as np

__all__ = [
    "Completer",
    "DeadlineExceeded",
    "Engine",
    "FerriteError",
    "InternalError",
    "InvalidInput",
    "Model",
    "ModelNotFound",
    "OutputBuffer",
    "Overloaded",
    "Pending",
    "Server",
    "Unavailable",
    "Unsupported",
    "init_runtime",
    "library_version",
    "install_crash_handler",
    "init_tracing",
    "serve",
    "shutdown_tracing",
]

class FerriteError(Exception): ...
class InvalidInput(FerriteError): ...
class ModelNotFound(FerriteError): ...
class Unavailable(FerriteError): ...
class Overloaded(Unavailable): ...
class DeadlineExceeded(FerriteError): ...
class Unsupported(FerriteError): ...
class InternalError(FerriteError): ...

def init_runtime(path: str) -> str: ...
def library_version(path: str) -> str: ...
def install_crash_handler(dir: str) -> str: ...

__version__: str
SUPPORTED_ONNXRUNTIME: str
def init_tracing(endpoint: Optional[str] = None, *, sample_rate: float = 1.0, log: str = "warn") -> None: ...
def shutdown_tracing() -> None: ...

_Tensor = Tuple[str, str, List[int]]

@final
class Engine:
    def __new__(
        cls,
        model_repository: str,
        *,
        threads: Optional[int] = None,
        max_request_elements: Optional[int] = None,
        max_concurrent_requests: Optional[int] = None,
        cache_bytes: Optional[int] = None,
        cache_ttl: float = 300.0,
        redis_url: Optional[str] = None,
        redis_timeout_ms: int = 5,
        cache_max_value_bytes: int = 1048576,
        tenant_header: Optional[str] = None,
        tenant_config: Optional[str] = None,
    ) -> Engine: ...
    def cache_stats(self) -> Optional[Dict[str, Any]]: ...
    def models(self) -> List[str]: ...
    def failed(self) -> List[Tuple[str, str]]: ...
    def model(self, name: str, version: Optional[str] = None) -> Model: ...
    def close(self, timeout: float = 30.0) -> int: ...

@final
class Model:
    @staticmethod
    def load(
        path: str,
        *,
        name: Optional[str] = None,
        max_batch_size: Optional[int] = None,
        max_queue_delay_us: Optional[int] = None,
        instance_count: Optional[int] = None,
        threads: Optional[int] = None,
        max_request_elements: Optional[int] = None,
        max_concurrent_requests: Optional[int] = None,
    ) -> Model: ...
    @property
    def name(self) -> str: ...
    def _stats(self) -> Tuple[int, int, int, int]: ...
    def _optional_inputs(self) -> List[str]: ...
    def _metadata(self) -> Tuple[str, str, str, int, List[_Tensor], List[_Tensor]]: ...
    def infer(
        self,
        inputs: Dict[str, Any],
        outputs: Optional[List[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Dict[str, np.ndarray]: ...
    def _submit(
        self,
        inputs: Dict[str, Any],
        outputs: Optional[List[str]],
        copy: bool,
        timeout_us: Optional[int],
        priority: int,
        completer: Completer,
        token: int,
        traceparent: Optional[str] = None,
    ) -> Pending: ...
    def _input_pointers(self, inputs: Dict[str, Any], copy: bool = False) -> List[Tuple[str, int]]: ...

@final
class Pending:
    def cancel(self) -> None: ...

@final
class Completer:
    def __new__(cls) -> Completer: ...
    def fileno(self) -> int: ...
    def drain(self) -> List[Tuple[int, Any, bool]]: ...

@final
class OutputBuffer:
    def __len__(self) -> int: ...

@final
class Server:
    @property
    def http_port(self) -> int: ...
    @property
    def grpc_port(self) -> int: ...
    def stop(self) -> None: ...

def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    max_body_bytes: int = 67108864,
    exit_timeout: float = 30.0,
    auth_token_file: Optional[str] = None,
    auth_allow_health: bool = False,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    tls_client_ca: Optional[str] = None,
    allow_unauthenticated: bool = False,
    shared_memory: str = "off",
) -> Server: ...
