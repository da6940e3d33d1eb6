"""Triton's `triton_python_backend_utils` as Ferrite provides it to Python models.

A model's `model.py` imports this module as Triton's Python backend documents it; Ferrite's worker
process (`ferrite_python_worker.py`) fills in the requests, reads back the responses and carries
BLS calls to the server. Nothing here needs Triton.
"""

import json

import numpy as np

# TRITONSERVER_DataType, as Triton numbers it.
TRITONSERVER_TYPE_INVALID = 0
TRITONSERVER_TYPE_BOOL = 1
TRITONSERVER_TYPE_UINT8 = 2
TRITONSERVER_TYPE_UINT16 = 3
TRITONSERVER_TYPE_UINT32 = 4
TRITONSERVER_TYPE_UINT64 = 5
TRITONSERVER_TYPE_INT8 = 6
TRITONSERVER_TYPE_INT16 = 7
TRITONSERVER_TYPE_INT32 = 8
TRITONSERVER_TYPE_INT64 = 9
TRITONSERVER_TYPE_FP16 = 10
TRITONSERVER_TYPE_FP32 = 11
TRITONSERVER_TYPE_FP64 = 12
TRITONSERVER_TYPE_BYTES = 13
TRITONSERVER_TYPE_BF16 = 14

# V2 datatype name <-> NumPy type, and <-> TRITONSERVER_DataType.
_V2 = {
    "BOOL": (np.bool_, TRITONSERVER_TYPE_BOOL),
    "UINT8": (np.uint8, TRITONSERVER_TYPE_UINT8),
    "UINT16": (np.uint16, TRITONSERVER_TYPE_UINT16),
    "UINT32": (np.uint32, TRITONSERVER_TYPE_UINT32),
    "UINT64": (np.uint64, TRITONSERVER_TYPE_UINT64),
    "INT8": (np.int8, TRITONSERVER_TYPE_INT8),
    "INT16": (np.int16, TRITONSERVER_TYPE_INT16),
    "INT32": (np.int32, TRITONSERVER_TYPE_INT32),
    "INT64": (np.int64, TRITONSERVER_TYPE_INT64),
    "FP16": (np.float16, TRITONSERVER_TYPE_FP16),
    "FP32": (np.float32, TRITONSERVER_TYPE_FP32),
    "FP64": (np.float64, TRITONSERVER_TYPE_FP64),
    "BYTES": (np.object_, TRITONSERVER_TYPE_BYTES),
}
_BY_NUMBER = {number: (name, np_type) for name, (np_type, number) in _V2.items()}


def triton_string_to_numpy(triton_type_string):
    """`TYPE_FP32` (a config's data_type) -> numpy.float32; `TYPE_STRING` -> numpy.object_."""
    name = triton_type_string[len("TYPE_"):] if triton_type_string.startswith("TYPE_") else triton_type_string
    if name == "STRING":
        name = "BYTES"
    return _V2[name][0] if name in _V2 else None


def triton_to_numpy_type(data_type):
    entry = _BY_NUMBER.get(data_type)
    return entry[1] if entry else None


# By NumPy dtype (native byte order), for the per-tensor lookups.
_BY_DTYPE = {np.dtype(np_type): (name, number) for name, (np_type, number) in _V2.items() if np_type is not np.object_}


def numpy_to_triton_type(data_type):
    """A NumPy type -> TRITONSERVER_DataType (bytes and strings are BYTES)."""
    dtype = data_type if isinstance(data_type, np.dtype) else np.dtype(data_type)
    entry = _BY_DTYPE.get(dtype)
    if entry is not None:
        return entry[1]
    if dtype.kind in ("O", "S", "U"):
        return TRITONSERVER_TYPE_BYTES
    return None


def _v2_name(dtype):
    """The V2 datatype name of a NumPy dtype, or None."""
    entry = _BY_DTYPE.get(dtype)
    if entry is not None:
        return entry[0]
    number = numpy_to_triton_type(dtype)
    return _BY_NUMBER[number][0] if number is not None else None


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message, code=INTERNAL):
        self._message = str(message)
        self._code = code

    def message(self):
        return self._message

    def code(self):
        return self._code

    def __repr__(self):
        return f"TritonError({self._message!r}, {self._code})"


class Tensor:
    """A named tensor backed by a NumPy array (a view of shared memory for a request's inputs)."""

    def __init__(self, name, array, *_):
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"tensor '{name}': expected a numpy.ndarray, got {type(array).__name__}")
        dtype = array.dtype
        if dtype not in _BY_DTYPE:
            if dtype.kind in ("S", "U"):
                array = np.array([_as_bytes(x) for x in array.reshape(-1)], dtype=np.object_).reshape(array.shape)
            elif dtype.kind != "O":
                raise TritonModelException(f"tensor '{name}': numpy dtype {dtype} has no Triton type")
        elif not array.flags.c_contiguous:
            # Non-contiguous arrays are copied, as Triton does.
            array = np.ascontiguousarray(array)
        self._name = name
        self._array = array

    @classmethod
    def _of(cls, name, array):
        """A tensor of an array the worker made (a request's input): nothing to check or copy."""
        t = cls.__new__(cls)
        t._name = name
        t._array = array
        return t

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def shape(self):
        return list(self._array.shape)

    def triton_dtype(self):
        return numpy_to_triton_type(self._array.dtype)

    def is_cpu(self):
        return True

    def to_dlpack(self):
        if self._array.dtype == np.object_:
            raise TritonModelException("a BYTES tensor has no DLPack form")
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name, capsule):
        if hasattr(capsule, "__dlpack__"):
            return Tensor(name, np.from_dlpack(capsule))
        raise TritonModelException("from_dlpack takes an object with __dlpack__ (a NumPy, PyTorch or CuPy tensor)")

    def __repr__(self):
        return f"Tensor({self._name!r}, {self._array.dtype}, {list(self._array.shape)})"


def _as_bytes(x):
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode("utf-8")
    if isinstance(x, (bytearray, memoryview, np.bytes_)):
        return bytes(x)
    return str(x).encode("utf-8")


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None, parameters=None):
        self._outputs = list(output_tensors or [])
        if error is not None and not isinstance(error, TritonError):
            error = TritonError(str(error))
        self._error = error
        self._parameters = parameters

    def parameters(self):
        p = self._parameters
        return p if isinstance(p, str) else json.dumps(p or {})

    def output_tensors(self):
        return self._outputs

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class InferenceRequest:
    """A request to this model (given to `execute`), or one made by the model to another (BLS)."""

    def __init__(self, model_name="", requested_output_names=None, inputs=None, model_version=-1, flags=0,
                 request_id="", correlation_id=0, timeout=0, preferred_memory=None, trace=None, parameters=None):
        self._model_name = model_name
        self._outputs = list(requested_output_names or [])
        self._inputs = list(inputs or [])
        self._model_version = model_version
        self._flags = flags
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._timeout = timeout
        # Kept as given (a dict from the server) and made JSON when asked for: most models never ask.
        self._parameters = "{}" if parameters is None else parameters
        self._cancelled = None  # set by the worker for the requests it gives to execute: (buffer, offset)

    def model_name(self):
        return self._model_name

    def inputs(self):
        return self._inputs

    def requested_output_names(self):
        return self._outputs

    def request_id(self):
        return self._request_id

    def correlation_id(self):
        return self._correlation_id

    def flags(self):
        return self._flags

    def timeout(self):
        return self._timeout

    def parameters(self):
        if not isinstance(self._parameters, str):
            self._parameters = json.dumps(self._parameters)
        return self._parameters

    def is_cancelled(self):
        return self._cancelled is not None and self._cancelled[0][self._cancelled[1]] != 0

    def get_response_sender(self):
        raise TritonModelException("decoupled models (a response sender) are not supported by Ferrite")

    def exec(self, decoupled=False):
        if decoupled:
            raise TritonModelException("decoupled BLS calls are not supported by Ferrite")
        if _worker is None:
            raise TritonModelException("BLS calls work only inside execute()")
        return _worker.bls(self)

    def async_exec(self, decoupled=False):
        import asyncio

        response = self.exec(decoupled)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise TritonModelException("async_exec() is awaited inside an `async def execute`") from None
        future = loop.create_future()
        future.set_result(response)
        return future


def get_input_tensor_by_name(request, name):
    for t in request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(response, name):
    for t in response.output_tensors():
        if t.name() == name:
            return t
    return None


def get_input_config_by_name(model_config, name):
    for t in model_config.get("input", []):
        if t.get("name") == name:
            return t
    return None


def get_output_config_by_name(model_config, name):
    for t in model_config.get("output", []):
        if t.get("name") == name:
            return t
    return None


class ModelConfig:
    """What `auto_complete_config` is given and returns: the config as Triton's JSON."""

    def __init__(self, model_config):
        self._config = json.loads(model_config) if isinstance(model_config, str) else model_config

    def as_dict(self):
        return self._config

    def _add(self, kind, tensor):
        if not isinstance(tensor, dict) or "name" not in tensor:
            raise TritonModelException(f"{kind} must be a dict with a 'name'")
        existing = [t for t in self._config.setdefault(kind, []) if t.get("name") == tensor["name"]]
        if existing:
            for key, value in tensor.items():
                if key in existing[0] and existing[0][key] not in (value, [], "", 0, "TYPE_INVALID"):
                    raise TritonModelException(
                        f"{kind} '{tensor['name']}': {key} {value!r} differs from the config's {existing[0][key]!r}")
                existing[0][key] = value
        else:
            self._config[kind].append(dict(tensor))

    def add_input(self, input):
        self._add("input", input)

    def add_output(self, output):
        self._add("output", output)

    def set_max_batch_size(self, max_batch_size):
        self._config["max_batch_size"] = int(max_batch_size)

    def max_batch_size(self):
        return int(self._config.get("max_batch_size", 0))

    def set_dynamic_batching(self):
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict):
        if transaction_policy_dict.get("decoupled"):
            raise TritonModelException("decoupled models are not supported by Ferrite")
        self._config["model_transaction_policy"] = dict(transaction_policy_dict)


class Logger:
    """Triton's `pb_utils.Logger`: lines go to the server's log, tagged with the model's name."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3

    @staticmethod
    def log(message, level=INFO):
        if _worker is not None:
            _worker.log(level, str(message))

    @staticmethod
    def log_info(message):
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message):
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message):
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message):
        Logger.log(message, Logger.VERBOSE)


class LogLevel:
    INFO = Logger.INFO
    WARNING = Logger.WARNING
    ERROR = Logger.ERROR
    VERBOSE = Logger.VERBOSE


# The worker process serving this model (set by it): carries BLS calls and log lines.
_worker = None
