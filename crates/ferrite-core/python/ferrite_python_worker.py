"""Ferrite's worker process for one instance of a Python model (Triton's `model.py`).

The server starts it with the control channel, a Unix socket, as standard input. Messages both
ways are a 4-byte little-endian length and a body: a JSON object, or for the one exchange made per
batch (an execute and its answer) a packed binary form (`EXECUTE`, `DONE` below), which costs
either side a fraction of JSON's encoding and decoding. Tensors never travel on the socket:
the server writes a batch's inputs into a shared-memory file this process maps (the requests'
arrays are views of it), and this process writes the responses' outputs into a file of its own
that the server reads back. BYTES elements are laid out as in Triton's binary form: a 4-byte
little-endian length, then the bytes.
"""

import importlib.util
import inspect
import json
import mmap
import os
import socket
import struct
import sys
import time
import traceback

import numpy as np

# This file's directory is first on sys.path (Python puts a script's there): Ferrite's pb_utils.
import triton_python_backend_utils as pb_utils

ALIGN = 64
# How long a worker polls for the next message before it sleeps: twice the recent wait between
# messages (a moving average), at least SPIN_MIN and at most SPIN_MAX; only SPIN_MIN when the
# waits are longer than SPIN_MAX (a model called now and then). Waking a sleeping process costs
# tens of microseconds twice a request; polling, which yields the core at each turn to whatever
# else wants it there, costs only a core that would have been idle.
SPIN_MIN, SPIN_MAX = 50e-6, 500e-6


# The packed messages, little-endian. A string is its length (u32; u8 for a datatype) then its
# UTF-8 bytes; a count is a u32; a tensor is its name, datatype, ndim (u8), dims (i64 each), then
# its offset and size (u64) in its file.
#   EXECUTE (server): 0x01, model, file, flags offset, requests (a count), then per request:
#                     its id, its parameters (JSON text), its tensors (a count) and each tensor.
#   DONE (worker):    0x02, file, responses (a count), then per response: 0x00, outputs (a count)
#                     and each tensor; or 0x01, a TritonError code (u32) and its message.
EXECUTE, DONE = 1, 2
_I, _B = struct.Struct("<I"), struct.Struct("<B")
_QQ = struct.Struct("<QQ")
_DIMS = [struct.Struct(f"<{n}q") for n in range(65)]
# Datatype names as they come (bytes) and go (NumPy dtype -> bytes).
_NUMPY = {name.encode(): np.dtype(t) for name, (t, _) in pb_utils._V2.items() if t is not np.object_}
_NAMES = {dtype: name.encode() for dtype, (name, _) in pb_utils._BY_DTYPE.items()}


def _text(body, at):
    """The packed string at `at` in `body`, and where the next field starts."""
    (n,) = _I.unpack_from(body, at)
    return body[at + 4:at + 4 + n].decode(), at + 4 + n


def _v2_bytes(dtype):
    """The V2 datatype name of a NumPy dtype, as bytes (empty: it has none)."""
    name = _NAMES.get(dtype)
    return name if name is not None else (pb_utils._v2_name(dtype) or "").encode()


class Inputs:
    """The server's current input file, mapped; arrays made from it keep their mapping alive."""

    def __init__(self):
        self.path = None
        self.map = None

    def view(self, path, end):
        if path != self.path or self.map is None or end > len(self.map):
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
            finally:
                os.close(fd)
            self.path = path
        return self.map

    def array(self, path, datatype, shape, offset, size):
        buf = self.view(path, offset + size)
        dtype = _NUMPY.get(datatype)
        if dtype is None:
            if datatype != b"BYTES":
                raise ValueError(f"unknown datatype {datatype!r}")
            items, at, end = [], offset, offset + size
            while at < end:
                (n,) = _I.unpack_from(buf, at)
                items.append(bytes(buf[at + 4:at + 4 + n]))
                at += 4 + n
            out = np.empty(len(items), dtype=np.object_)
            out[:] = items
            return out.reshape(shape)
        if buf is None:
            return np.empty(shape, dtype=dtype)
        return np.ndarray(shape, dtype, buffer=buf, offset=offset)

    def tensor(self, path, t):
        """A tensor described in JSON (a BLS answer)."""
        return pb_utils.Tensor._of(t["name"], self.array(path, t["datatype"].encode(), tuple(t["shape"]),
                                                         t["offset"], t["size"]))


class Outputs:
    """This process's output file: written from 0 for each reply, replaced by a larger one when
    a reply does not fit (and by a smaller one after a burst)."""

    def __init__(self, directory):
        self.directory = directory
        self.path = None
        self.map = None
        self.serial = 0

    def _replace(self, size):
        self.serial += 1
        path = os.path.join(self.directory, f"out-{os.getpid()}-{self.serial}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.path = path

    def write(self, arrays):
        """Lays `arrays` (NumPy arrays) out from offset 0; returns [(offset, size)] and the path."""
        blobs, total = [], 0
        for a in arrays:
            if a.dtype == np.object_:
                parts = []
                for x in a.reshape(-1):
                    b = x if isinstance(x, bytes) else pb_utils._as_bytes(x)
                    parts.append(struct.pack("<I", len(b)))
                    parts.append(b)
                data = b"".join(parts)
                size = len(data)
            else:
                data = a if a.flags.c_contiguous else np.ascontiguousarray(a)
                size = data.nbytes
            offset = (total + ALIGN - 1) // ALIGN * ALIGN
            blobs.append((offset, size, data))
            total = offset + size
        capacity = len(self.map) if self.map is not None else 0
        if total > capacity or (capacity > (64 << 20) and total < capacity // 4):
            self._replace(max(total, 1 << 16) if total <= capacity else max(total, 2 * capacity, 1 << 16))
        placed = []
        for offset, size, data in blobs:
            if isinstance(data, bytes):
                self.map[offset:offset + size] = data
            elif size:
                self.map[offset:offset + size] = data.data.cast("B")
            placed.append((offset, size))
        return placed, self.path

    def close(self):
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None


class Worker:
    def __init__(self, chan):
        self.chan = chan
        self.pending = bytearray()
        self.inputs = Inputs()
        self.outputs = None
        self.model = None
        self.in_execute = False
        self.flags = None
        self.output_names = []
        self.loop = None
        # The moving average of the waits for a message (seconds).
        self.gap = SPIN_MAX

    # The channel.
    def send(self, message):
        data = message if isinstance(message, bytes) else json.dumps(message, separators=(",", ":")).encode()
        self.chan.sendall(_I.pack(len(data)) + data)

    def recv(self):
        """The next message (a dict, or the bytes of a packed one), or None when the server has gone."""
        while True:
            if len(self.pending) >= 4:
                (n,) = _I.unpack_from(self.pending)
                if len(self.pending) >= 4 + n:
                    body = bytes(self.pending[4:4 + n])
                    del self.pending[:4 + n]
                    return body if body[:1] == b"\x01" else json.loads(body)
            chunk = self._read()
            if not chunk:
                return None
            self.pending += chunk

    def _read(self):
        # Polls for up to the spin the recent waits call for (see SPIN_MIN), then sleeps.
        start = time.perf_counter()
        deadline = start + (min(SPIN_MAX, max(SPIN_MIN, 2 * self.gap)) if self.gap <= SPIN_MAX else SPIN_MIN)
        chunk = None
        while chunk is None and time.perf_counter() < deadline:
            try:
                chunk = self.chan.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                os.sched_yield()
        if chunk is None:
            chunk = self.chan.recv(1 << 20)
        self.gap += (min(time.perf_counter() - start, 1.0) - self.gap) / 8
        return chunk

    # What pb_utils asks of the worker.
    def log(self, level, message):
        self.send({"op": "log", "level": level, "message": message})

    def bls(self, request):
        if not self.in_execute:
            raise pb_utils.TritonModelException("BLS calls work only inside execute()")
        arrays = [t.as_numpy() for t in request.inputs()]
        placed, path = self.outputs.write(arrays)
        inputs = []
        for t, a, (offset, size) in zip(request.inputs(), arrays, placed):
            inputs.append({"name": t.name(), "datatype": pb_utils._v2_name(a.dtype), "shape": list(a.shape),
                           "offset": offset, "size": size})
        version = request._model_version
        self.send({"op": "infer", "file": path, "model": request.model_name(),
                   "version": "" if version in (None, -1, "") else str(version), "inputs": inputs,
                   "outputs": request.requested_output_names(), "id": request.request_id(),
                   "timeout_us": int(request.timeout() or 0), "parameters": request.parameters()})
        while True:
            reply = self.recv()
            if reply is None:
                sys.exit(0)
            if reply.get("op") == "infer_result":
                break
        if reply.get("error") is not None:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(reply["error"], reply.get("code", 1)))
        tensors = [self.inputs.tensor(reply["file"], t) for t in reply["outputs"]]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # The model's life.
    def initialize(self, message):
        self.outputs = Outputs(message["dir"])
        path = message["model_py"]
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location("model", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["model"] = module
        spec.loader.exec_module(module)
        cls = getattr(module, "TritonPythonModel", None)
        if cls is None:
            raise RuntimeError(f"{path} defines no class TritonPythonModel")
        if message.get("auto_complete"):
            config = pb_utils.ModelConfig(message["args"]["model_config"])
            if hasattr(cls, "auto_complete_config"):
                config = cls.auto_complete_config(config)
            return {"op": "config", "config": config.as_dict()}
        config = json.loads(message["args"]["model_config"])
        self.output_names = [o["name"] for o in config.get("output", [])]
        self.model = cls()
        if hasattr(self.model, "initialize"):
            self.model.initialize(message["args"])
        return {"op": "ready"}

    def requests(self, body):
        """The requests of a packed EXECUTE, their arrays mapped from the server's file."""
        model, at = _text(body, 1)
        path, at = _text(body, at)
        flags, count = struct.unpack_from("<II", body, at)
        at += 8
        # Each request's byte in the flags (set when its client leaves) is what is_cancelled() reads.
        buf = self.inputs.view(path, flags + count)
        array, tensor = self.inputs.array, pb_utils.Tensor._of
        requests = []
        for i in range(count):
            request_id, at = _text(body, at)
            parameters, at = _text(body, at)
            (k,) = _I.unpack_from(body, at)
            at += 4
            tensors = []
            for _ in range(k):
                name, at = _text(body, at)
                n = body[at]
                datatype = body[at + 1:at + 1 + n]
                at += 1 + n
                ndim = body[at]
                shape = _DIMS[ndim].unpack_from(body, at + 1)
                at += 1 + 8 * ndim
                offset, size = _QQ.unpack_from(body, at)
                at += 16
                tensors.append(tensor(name, array(path, datatype, shape, offset, size)))
            request = pb_utils.InferenceRequest(model, self.output_names, tensors, request_id=request_id,
                                                parameters=parameters or "{}")
            request._cancelled = (buf, flags + i)
            requests.append(request)
        return requests

    def execute(self, body):
        """Runs the model's execute on a packed EXECUTE: a packed DONE, or a dict when it failed."""
        requests = self.requests(body)
        self.in_execute = True
        try:
            responses = self.model.execute(requests)
            if not isinstance(responses, list) and inspect.isawaitable(responses):
                # `async def execute` (BLS with async_exec): run on this worker's own loop.
                if self.loop is None:
                    import asyncio

                    self.loop = asyncio.new_event_loop()
                responses = self.loop.run_until_complete(responses)
        except Exception as e:  # noqa: BLE001 -- the model's error answers its requests
            return {"op": "failed", "message": f"{type(e).__name__}: {e}"}
        finally:
            self.in_execute = False
        if not isinstance(responses, (list, tuple)) or len(responses) != len(requests):
            n = len(responses) if isinstance(responses, (list, tuple)) else type(responses).__name__
            return {"op": "failed",
                    "message": f"execute returned {n} responses for {len(requests)} requests (one each is needed)"}
        try:
            return self.done(responses)
        except Exception as e:  # noqa: BLE001 -- an output that cannot be sent fails its call
            return {"op": "failed", "message": f"the responses cannot be sent: {type(e).__name__}: {e}"}

    def done(self, responses):
        """The packed DONE of `responses`, their outputs written to this worker's file."""
        arrays, answers = [], []
        for r in responses:
            if not isinstance(r, pb_utils.InferenceResponse):
                answers.append((pb_utils.TritonError.INTERNAL, "execute returned no InferenceResponse for this request"))
                continue
            outputs = r.output_tensors()
            if r.has_error() and not outputs:
                code = r.error().code()
                answers.append((code if isinstance(code, int) and 0 <= code < 1 << 32 else 1, r.error().message()))
                continue
            names = []
            for t in outputs:
                a = t.as_numpy()
                names.append((t.name().encode(), _v2_bytes(a.dtype), a.shape))
                arrays.append(a)
            answers.append(names)
        placed, out_path = self.outputs.write(arrays)
        path = (out_path or "").encode()
        parts = [bytes((DONE,)), _I.pack(len(path)), path, _I.pack(len(answers))]
        k = 0
        for a in answers:
            if isinstance(a, tuple):
                message = a[1].encode()
                parts += (b"\x01", _I.pack(a[0]), _I.pack(len(message)), message)
                continue
            parts += (b"\x00", _I.pack(len(a)))
            for name, datatype, shape in a:
                parts += (_I.pack(len(name)), name, _B.pack(len(datatype)), datatype, _B.pack(len(shape)),
                          _DIMS[len(shape)].pack(*shape), _QQ.pack(*placed[k]))
                k += 1
        return b"".join(parts)

    def finalize(self):
        try:
            if self.model is not None and hasattr(self.model, "finalize"):
                self.model.finalize()
        finally:
            if self.outputs is not None:
                self.outputs.close()

    def serve(self):
        pb_utils._worker = self
        while True:
            message = self.recv()
            if message is None:
                # The server is gone (exited or killed): the model still gets its finalize.
                self.finalize()
                return
            if isinstance(message, bytes):
                self.send(self.execute(message))
                continue
            op = message.get("op")
            if op == "init":
                try:
                    self.send(self.initialize(message))
                except Exception as e:  # noqa: BLE001
                    self.send({"op": "error", "message": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()})
                    return
            elif op == "finalize":
                try:
                    self.finalize()
                finally:
                    self.send({"op": "finalized"})
                return


def main():
    # The channel is standard input; the model's own reads of stdin get nothing.
    chan = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    Worker(chan).serve()


if __name__ == "__main__":
    main()
