"""Ferrite's worker process for one instance of a Python model (Triton's `model.py`).

The server starts it with the control channel, a Unix socket, as standard input. Messages both
ways are a 4-byte little-endian length and a JSON object. Tensors never travel on the socket:
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
# How long a worker polls for the next message before it sleeps (the server's batcher threads
# spin as long for theirs): under load the next batch comes within it.
SPIN_SECONDS = float(os.environ.get("FERRITE_PYTHON_SPIN_US", "50")) / 1e6


def _dtype(datatype):
    return pb_utils.triton_string_to_numpy(datatype)


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

    def array(self, path, t):
        shape = tuple(t["shape"])
        offset, size = t["offset"], t["size"]
        buf = self.view(path, offset + size)
        if t["datatype"] == "BYTES":
            items, at, end = [], offset, offset + size
            while at < end:
                (n,) = struct.unpack_from("<I", buf, at)
                items.append(bytes(buf[at + 4:at + 4 + n]))
                at += 4 + n
            out = np.empty(len(items), dtype=np.object_)
            out[:] = items
            return out.reshape(shape)
        dtype = np.dtype(_dtype(t["datatype"]))
        count = size // dtype.itemsize
        if buf is None:
            return np.empty(shape, dtype=dtype)
        return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)


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
                data = np.ascontiguousarray(a)
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
                dst = np.frombuffer(self.map, dtype=np.uint8, count=size, offset=offset)
                dst[:] = data.reshape(-1).view(np.uint8)
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

    # The channel.
    def send(self, message):
        data = json.dumps(message, separators=(",", ":")).encode("utf-8")
        self.chan.sendall(struct.pack("<I", len(data)) + data)

    def recv(self):
        """The next message, or None when the server has gone."""
        while True:
            if len(self.pending) >= 4:
                (n,) = struct.unpack_from("<I", self.pending)
                if len(self.pending) >= 4 + n:
                    body = bytes(self.pending[4:4 + n])
                    del self.pending[:4 + n]
                    return json.loads(body)
            chunk = self._read()
            if not chunk:
                return None
            self.pending += chunk

    def _read(self):
        # Requests often follow each other closely: a moment of polling before sleeping saves
        # the wake-up of a sleeping process (tens of microseconds) when the next one is near.
        deadline = time.perf_counter() + SPIN_SECONDS
        while time.perf_counter() < deadline:
            try:
                return self.chan.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        return self.chan.recv(1 << 20)

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
        tensors = [pb_utils.Tensor(t["name"], self.inputs.array(reply["file"], t)) for t in reply["outputs"]]
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

    def execute(self, message):
        path = message["file"]
        flags = message["flags"]
        model = message.get("model", "")
        requests = []
        # Each request's byte in the flags (set when its client leaves) is what is_cancelled() reads.
        buf = self.inputs.view(path, flags + len(message["requests"]))
        for i, r in enumerate(message["requests"]):
            tensors = [pb_utils.Tensor(t["name"], self.inputs.array(path, t)) for t in r["inputs"]]
            req = pb_utils.InferenceRequest(model, r["outputs"] or self.output_names, tensors,
                                            request_id=r["id"], parameters=r["parameters"])
            req._cancelled = (buf, flags + i)
            requests.append(req)
        self.in_execute = True
        try:
            responses = self.model.execute(requests)
            if inspect.isawaitable(responses):
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
        arrays, shapes, answers = [], [], []
        for r in responses:
            if r is None or not isinstance(r, pb_utils.InferenceResponse):
                answers.append({"error": "execute returned no InferenceResponse for this request", "code": 1})
                continue
            if r.has_error() and not r.output_tensors():
                answers.append({"error": r.error().message(), "code": r.error().code()})
                continue
            names = []
            for t in r.output_tensors():
                a = t.as_numpy()
                names.append((t.name(), pb_utils._v2_name(a.dtype), list(a.shape)))
                arrays.append(a)
            answers.append({"outputs": names})
        placed, out_path = self.outputs.write(arrays)
        k = 0
        for a in answers:
            if "outputs" in a:
                outs = []
                for name, datatype, shape in a["outputs"]:
                    offset, size = placed[k]
                    k += 1
                    outs.append({"name": name, "datatype": datatype, "shape": shape, "offset": offset,
                                 "size": size})
                a["outputs"] = outs
        return {"op": "done", "file": out_path, "responses": answers}

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
            op = message.get("op")
            if op == "init":
                try:
                    self.send(self.initialize(message))
                except Exception as e:  # noqa: BLE001
                    self.send({"op": "error", "message": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc()})
                    return
            elif op == "execute":
                self.send(self.execute(message))
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
