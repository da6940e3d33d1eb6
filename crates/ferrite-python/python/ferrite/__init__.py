"""Ferrite in-process: the same engine as the `ferrite` server, called directly from Python.

    import numpy as np, ferrite
    model = ferrite.Model.load("models/mlp")
    out = model.infer({"input": np.ones((1, 512), np.float32)})
    out = await model.infer_async({"input": x})

Inputs that are C-contiguous arrays of the model's dtype are read in place (no copy); outputs are
read-only NumPy arrays over the engine's own buffers (no copy). The GIL is released while a
request waits and runs, so calls from many threads and coroutines share the dynamic batcher.
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import os
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import _native
from ._native import (
    DeadlineExceeded,
    FerriteError,
    InternalError,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    Unavailable,
    Unsupported,
)

__all__ = [
    "Engine",
    "Model",
    "ModelMetadata",
    "TensorSpec",
    "Server",
    "serve",
    "init_tracing",
    "shutdown_tracing",
    "FerriteError",
    "InvalidInput",
    "ModelNotFound",
    "Unavailable",
    "Overloaded",
    "DeadlineExceeded",
    "Unsupported",
    "InternalError",
]

_runtime_path: Optional[str] = None


def _init_runtime() -> None:
    """Loads the ONNX Runtime library that the `onnxruntime` package ships (once)."""
    global _runtime_path
    if _runtime_path is not None:
        return
    path = os.environ.get("ORT_DYLIB_PATH")
    if not path:
        import onnxruntime

        libs = sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))
        if not libs:
            raise FerriteError("the onnxruntime package has no capi/libonnxruntime.so*; reinstall onnxruntime==1.31.*")
        path = libs[-1]
    _runtime_path = _native.init_runtime(path)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: Tuple[int, ...]
    """-1 marks a variable dimension (the batch dimension when the model batches)."""


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    version: str
    platform: str
    max_batch_size: int
    inputs: Tuple[TensorSpec, ...]
    outputs: Tuple[TensorSpec, ...]


class _LoopState:
    """Per event loop: one completion pipe, and the futures waiting on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.completer = _native.Completer()
        self.futures: Dict[int, asyncio.Future] = {}
        self.fd = self.completer.fileno()
        os.set_blocking(self.fd, False)
        loop.add_reader(self.fd, self._drain)

    def _drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        for token, value, ok in self.completer.drain():
            fut = self.futures.pop(token, None)
            if fut is None or fut.done():
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)


_loops: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState]" = weakref.WeakKeyDictionary()
_tokens = itertools.count()


def _loop_state(loop: asyncio.AbstractEventLoop) -> _LoopState:
    state = _loops.get(loop)
    if state is None:
        state = _loops[loop] = _LoopState(loop)
    return state


class Model:
    """One served model. Get one from `Model.load(...)` or `Engine.model(name)`."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self._metadata: Optional[ModelMetadata] = None

    @staticmethod
    def load(
        path: "os.PathLike[str] | str",
        *,
        name: Optional[str] = None,
        max_batch_size: Optional[int] = None,
        max_queue_delay_us: Optional[int] = None,
        instance_count: Optional[int] = None,
        threads: Optional[int] = None,
        max_request_elements: Optional[int] = None,
    ) -> "Model":
        """Loads a model directory (`config.toml`, `<version>/model.onnx`) or one `.onnx` file;
        keyword arguments override its config."""
        _init_runtime()
        return Model(
            _native.Model.load(
                os.fspath(path),
                name=name,
                max_batch_size=max_batch_size,
                max_queue_delay_us=max_queue_delay_us,
                instance_count=instance_count,
                threads=threads,
                max_request_elements=max_request_elements,
            )
        )

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def metadata(self) -> ModelMetadata:
        if self._metadata is None:
            name, version, platform, mbs, inputs, outputs = self._native._metadata()
            self._metadata = ModelMetadata(
                name=name,
                version=version,
                platform=platform,
                max_batch_size=mbs,
                inputs=tuple(TensorSpec(n, d, tuple(s)) for n, d, s in inputs),
                outputs=tuple(TensorSpec(n, d, tuple(s)) for n, d, s in outputs),
            )
        return self._metadata

    def infer(
        self,
        inputs: Mapping[str, Any],
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Dict[str, np.ndarray]:
        """Runs one request. Arrays are read in place when C-contiguous and of the model's dtype;
        anything else raises TypeError/ValueError unless `copy=True`. Ctrl-C interrupts the wait.
        `traceparent` (W3C) makes the request's spans children of the caller's span."""
        return self._native.infer(
            dict(inputs),
            list(outputs) if outputs is not None else None,
            copy=copy,
            timeout_us=timeout_us,
            priority=priority,
            traceparent=traceparent,
        )

    async def infer_async(
        self,
        inputs: Mapping[str, Any],
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Dict[str, np.ndarray]:
        """As `infer`, without blocking the event loop. Cancelling the await drops the request if
        it has not run yet."""
        loop = asyncio.get_running_loop()
        state = _loop_state(loop)
        token = next(_tokens)
        fut = loop.create_future()
        state.futures[token] = fut
        try:
            pending = self._native._submit(
                dict(inputs),
                list(outputs) if outputs is not None else None,
                copy,
                timeout_us,
                priority,
                state.completer,
                token,
                traceparent,
            )
        except BaseException:
            del state.futures[token]
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            pending.cancel()
            state.futures.pop(token, None)
            raise

    def __repr__(self) -> str:
        return f"ferrite.Model({self.name!r})"


def init_tracing(endpoint: Optional[str] = None, *, sample_rate: float = 1.0, log: str = "warn") -> None:
    """Exports the engine's spans over OTLP/gRPC (`endpoint`, default OTEL_EXPORTER_OTLP_ENDPOINT).
    Requests given a `traceparent` are always traced; others at `sample_rate`."""
    _native.init_tracing(endpoint, sample_rate=sample_rate, log=log)


def shutdown_tracing() -> None:
    """Sends buffered spans and stops exporting."""
    _native.shutdown_tracing()


class Engine:
    """Every model of a repository (`<dir>/<name>/<version>/model.onnx`), in-process."""

    def __init__(
        self,
        model_repository: "os.PathLike[str] | str" = "models",
        *,
        threads: Optional[int] = None,
        max_request_elements: Optional[int] = None,
    ) -> None:
        _init_runtime()
        self._native = _native.Engine(os.fspath(model_repository), threads=threads, max_request_elements=max_request_elements)

    @property
    def models(self) -> Tuple[str, ...]:
        return tuple(self._native.models())

    @property
    def failed(self) -> Dict[str, str]:
        """Model directories that did not load, with the reason."""
        return dict(self._native.failed())

    def model(self, name: str, version: Optional[str] = None) -> Model:
        return Model(self._native.model(name, version))

    def close(self, timeout: float = 30.0) -> int:
        """Stops taking requests and drains queued ones; returns how many had to be failed."""
        return self._native.close(timeout)


class Server:
    """HTTP and gRPC servers running in a background thread; see `serve`."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def http_port(self) -> int:
        return self._native.http_port

    @property
    def grpc_port(self) -> int:
        return self._native.grpc_port

    def stop(self) -> None:
        """Readiness off, queued work drained, listeners closed."""
        self._native.stop()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    max_body_bytes: int = 64 << 20,
    exit_timeout: float = 30.0,
    auth_token_file: "Optional[os.PathLike[str] | str]" = None,
    auth_allow_health: bool = False,
    tls_cert: "Optional[os.PathLike[str] | str]" = None,
    tls_key: "Optional[os.PathLike[str] | str]" = None,
    tls_client_ca: "Optional[os.PathLike[str] | str]" = None,
    allow_unauthenticated: bool = False,
) -> Server:
    """Serves `engine`'s models over HTTP and gRPC (KServe V2) from a background thread, sharing
    their batchers with in-process calls. Port 0 picks a free port (see `Server.http_port`).

    The security options are the `ferrite` binary's: bearer tokens from `auth_token_file` (the
    `--auth-token-file` format), TLS from `tls_cert`/`tls_key` (mutual with `tls_client_ca`). A
    `host` other than loopback needs a token file, or `allow_unauthenticated=True` said outright."""
    def path(p: "Optional[os.PathLike[str] | str]") -> Optional[str]:
        return None if p is None else os.fspath(p)

    return Server(
        _native.serve(
            engine._native,
            host=host,
            http_port=http_port,
            grpc_port=grpc_port,
            max_body_bytes=max_body_bytes,
            exit_timeout=exit_timeout,
            auth_token_file=path(auth_token_file),
            auth_allow_health=auth_allow_health,
            tls_cert=path(tls_cert),
            tls_key=path(tls_key),
            tls_client_ca=path(tls_client_ca),
            allow_unauthenticated=allow_unauthenticated,
        )
    )
