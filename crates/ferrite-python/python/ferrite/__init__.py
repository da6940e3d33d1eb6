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
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Protocol, Sequence, Tuple, Union, overload

import numpy as np

from . import _native
from ._signature import Signature, field_name
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

__version__: str = _native.__version__

__all__ = [
    "__version__",
    "check_environment",
    "enable_crash_reports",
    "onnxruntime_version",
    "Engine",
    "Model",
    "ModelMetadata",
    "ModelStats",
    "Signature",
    "TypedInputs",
    "field_name",
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


def _library_path() -> str:
    """The ONNX Runtime library to load: ORT_DYLIB_PATH, else the one the `onnxruntime` package ships."""
    path = os.environ.get("ORT_DYLIB_PATH")
    if path:
        return path
    try:
        import onnxruntime
    except ImportError as e:
        raise FerriteError(
            f"the onnxruntime package is not installed: pip install 'onnxruntime=={_native.SUPPORTED_ONNXRUNTIME}.*'"
        ) from e
    libs = sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))
    if not libs:
        raise FerriteError(
            f"the onnxruntime package has no capi/libonnxruntime.so*; reinstall onnxruntime=={_native.SUPPORTED_ONNXRUNTIME}.*"
        )
    return libs[-1]


def _init_runtime() -> None:
    """Loads the ONNX Runtime library (once), after checking its version: a library outside the
    supported range raises InvalidInput saying what was found and what to install."""
    global _runtime_path
    if _runtime_path is not None:
        return
    path = _library_path()
    _native.library_version(path)
    _runtime_path = _native.init_runtime(path)


def enable_crash_reports(crash_dir: "os.PathLike[str] | str" = ".") -> str:
    """Should a fatal signal (a fault inside ONNX Runtime) end the process, writes
    `<crash_dir>/ferrite-crash-<pid>.txt` first: time, versions, the model, version and worker
    thread that was running with its batch's input names, dtypes and shapes (never the data), the
    native backtrace, then every Python thread's stack (faulthandler's dump; "Current thread" is
    the one that held the GIL). Returns the report's path."""
    import faulthandler

    _init_runtime()
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    return _native.install_crash_handler(os.fspath(crash_dir))


def onnxruntime_version() -> str:
    """The version of the ONNX Runtime library Ferrite loads (or would load), as it reports it."""
    return _native.library_version(_library_path())


def check_environment(file: Any = None) -> bool:
    """Prints Python, NumPy, ONNX Runtime (package and library) and Ferrite versions, and whether
    each fits what Ferrite needs; returns True when all do."""
    out = file if file is not None else sys.stdout
    rows = []
    python = ".".join(map(str, sys.version_info[:3]))
    rows.append(("python", python, sys.version_info >= (3, 9), ">= 3.9"))
    numpy_major_minor = tuple(int(p) for p in np.__version__.split(".")[:2])
    rows.append(("numpy", np.__version__, numpy_major_minor >= (1, 21), ">= 1.21"))
    wanted = _native.SUPPORTED_ONNXRUNTIME
    try:
        import onnxruntime

        package = getattr(onnxruntime, "__version__", "?")
        rows.append(("onnxruntime (package)", package, package.startswith(wanted + "."), f"{wanted}.*"))
    except ImportError:
        rows.append(("onnxruntime (package)", "not installed", False, f"pip install 'onnxruntime=={wanted}.*'"))
    try:
        path = _library_path()
        try:
            rows.append(("onnxruntime (library)", f"{_native.library_version(path)} at {path}", True, f">= {wanted}"))
        except InvalidInput as e:
            rows.append(("onnxruntime (library)", path, False, str(e)))
    except FerriteError as e:
        rows.append(("onnxruntime (library)", "not found", False, str(e)))
    rows.append(("ferrite", __version__, True, ""))
    width = max(len(r[0]) for r in rows)
    for name, version, fits, needed in rows:
        note = "ok" if fits else f"NEEDS {needed}"
        print(f"{name:<{width}}  {version}  {note}", file=out)
    return all(r[2] for r in rows)


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


class TypedInputs(Protocol):
    """An instance of a model's `signature.Inputs`."""

    __ferrite_fields__: Tuple[Tuple[str, str], ...]


@dataclass(frozen=True)
class ModelStats:
    inferences: int
    executions: int
    cache_hits: int
    cache_misses: int


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
        self._signature: Optional[Signature] = None

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
        max_concurrent_requests: Optional[int] = None,
    ) -> "Model":
        """Loads a model directory (`config.toml`, `<version>/model.onnx`) or one `.onnx` file;
        keyword arguments override its config. `max_concurrent_requests` bounds the calls in the
        model at once (queued or running, sync and async alike): past it, a call raises
        `Overloaded` at once instead of queueing (an application serving its own clients sheds
        load rather than letting the queue grow)."""
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
                max_concurrent_requests=max_concurrent_requests,
            )
        )

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def signature(self) -> Signature:
        """Dataclass types generated from the model's metadata: `signature.Inputs` and
        `signature.Outputs`, a field per tensor (ferrite._signature states the naming rule), each
        a NumPy array of the tensor's dtype. `Inputs(...)` validates on construction (unknown or
        missing fields, dtype, shape: the server's messages); `infer(signature.Inputs(...))`
        returns `signature.Outputs`."""
        if self._signature is None:
            meta = self.metadata
            self._signature = Signature(meta.name, meta.inputs, meta.outputs, self._native._optional_inputs())
        return self._signature

    def pydantic_models(self) -> Tuple[Any, Any]:
        """(Request, Response) Pydantic v2 models of the model's JSON bodies, for FastAPI routes
        (documented schemas, 422 with the reason for a bad body); see `Signature.pydantic_models`."""
        return self.signature.pydantic_models(self.metadata)

    def stats(self) -> ModelStats:
        """Rows inferred, batches executed, and response-cache hits and misses so far."""
        return ModelStats(*self._native._stats())

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

    @overload
    def infer(
        self,
        inputs: Mapping[str, Any],
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Dict[str, np.ndarray]: ...

    @overload
    def infer(
        self,
        inputs: TypedInputs,
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Any: ...

    def infer(
        self,
        inputs: Union[Mapping[str, Any], TypedInputs],
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Any:
        """Runs one request. Arrays are read in place when C-contiguous and of the model's dtype;
        anything else raises TypeError/ValueError unless `copy=True`. Ctrl-C interrupts the wait.
        `traceparent` (W3C) makes the request's spans children of the caller's span.
        Given a `signature.Inputs`, returns a `signature.Outputs`."""
        typed = hasattr(inputs, "__ferrite_fields__")
        result = self._native.infer(
            self.signature.to_tensors(inputs) if typed else dict(inputs),  # type: ignore[arg-type]
            list(outputs) if outputs is not None else None,
            copy=copy,
            timeout_us=timeout_us,
            priority=priority,
            traceparent=traceparent,
        )
        return self.signature.outputs(result) if typed else result

    @overload
    async def infer_async(
        self,
        inputs: Mapping[str, Any],
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Dict[str, np.ndarray]: ...

    @overload
    async def infer_async(
        self,
        inputs: TypedInputs,
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Any: ...

    async def infer_async(
        self,
        inputs: Union[Mapping[str, Any], TypedInputs],
        outputs: Optional[Sequence[str]] = None,
        *,
        copy: bool = False,
        timeout_us: Optional[int] = None,
        priority: int = 0,
        traceparent: Optional[str] = None,
    ) -> Any:
        """As `infer`, without blocking the event loop. Cancelling the await drops the request if
        it has not run yet. Given a `signature.Inputs`, returns a `signature.Outputs`."""
        typed = hasattr(inputs, "__ferrite_fields__")
        loop = asyncio.get_running_loop()
        state = _loop_state(loop)
        token = next(_tokens)
        fut = loop.create_future()
        state.futures[token] = fut
        try:
            pending = self._native._submit(
                self.signature.to_tensors(inputs) if typed else dict(inputs),  # type: ignore[arg-type]
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
            result = await fut
        except asyncio.CancelledError:
            pending.cancel()
            state.futures.pop(token, None)
            raise
        return self.signature.outputs(result) if typed else result

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
        max_concurrent_requests: Optional[int] = None,
        cache_bytes: Optional[int] = None,
        cache_ttl: float = 300.0,
        redis_url: Optional[str] = None,
        redis_timeout_ms: int = 5,
        cache_max_value_bytes: int = 1 << 20,
        crash_dir: "Optional[os.PathLike[str] | str]" = None,
        tenant_header: Optional[str] = None,
        tenant_config: "Optional[os.PathLike[str] | str]" = None,
    ) -> None:
        """`cache_bytes` and/or `redis_url` give the engine the server's two-tier response cache
        (in-process, then Redis shared with other processes), used by the models whose config
        says `[cache] enabled = true` (Triton's `response_cache { enable: true }`). `crash_dir`
        turns crash reports on (see `enable_crash_reports`). `tenant_header` and `tenant_config`
        are the binary's `--tenant-header` and `--tenant-config`, for the requests a `serve()`d
        server takes: the header names a request's tenant, the file holds per-tenant limits and
        cache pools. The application's own calls take no tenant's place. `max_concurrent_requests`
        is the binary's `--max-concurrent-requests`: past that many requests in the engine at once
        (the application's own calls and its servers' together), a call raises `Overloaded` and a
        server's client gets 429 / RESOURCE_EXHAUSTED."""
        _init_runtime()
        if crash_dir is not None:
            enable_crash_reports(crash_dir)
        self._native = _native.Engine(
            os.fspath(model_repository),
            threads=threads,
            max_request_elements=max_request_elements,
            max_concurrent_requests=max_concurrent_requests,
            cache_bytes=cache_bytes,
            cache_ttl=cache_ttl,
            redis_url=redis_url,
            redis_timeout_ms=redis_timeout_ms,
            cache_max_value_bytes=cache_max_value_bytes,
            tenant_header=tenant_header,
            tenant_config=None if tenant_config is None else os.fspath(tenant_config),
        )

    def cache_stats(self) -> Optional[Dict[str, Any]]:
        """The response cache's state and the lookups that hit and missed; None without a cache."""
        return self._native.cache_stats()

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
        """Closes the listeners once the requests they hold are answered (for at most
        `exit_timeout`). The engine stays open: in-process calls go on, and a later `serve` can
        listen again."""
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
    shared_memory: str = "off",
) -> Server:
    """Serves `engine`'s models over HTTP and gRPC (KServe V2) from a background thread, sharing
    their batchers with in-process calls. Port 0 picks a free port (see `Server.http_port`).

    The security options are the `ferrite` binary's: bearer tokens from `auth_token_file` (the
    `--auth-token-file` format), TLS from `tls_cert`/`tls_key` (mutual with `tls_client_ca`). A
    `host` (an IP address, or a name: every address it resolves to) other than loopback needs a
    token file, or `allow_unauthenticated=True` said outright.
    `shared_memory="system"` turns on Triton's system shared-memory extension (the binary's
    `--shared-memory system`): clients on this host send and receive tensors through POSIX
    shared-memory objects they register; such a client can read any object this process can
    open, so it is off unless asked for."""
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
            shared_memory=shared_memory,
        )
    )
