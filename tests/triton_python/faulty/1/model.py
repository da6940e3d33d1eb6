import json
import os
import time

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Does what its input says: raise, crash, hang, allocate, or answer an error; else echoes.
    Marks its initialize and finalize in $FAULTY_MARKS (a directory), when set."""

    def _mark(self, what):
        marks = os.environ.get("FAULTY_MARKS")
        if marks:
            with open(os.path.join(marks, f"{what}-{os.getpid()}"), "w") as f:
                f.write(what)

    def initialize(self, args):
        self._mark("initialize")
        self.hoard = []

    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            if action == "raise":
                raise ValueError("asked to raise")
            if action == "crash":
                os._exit(3)
            if action == "hang":
                while not request.is_cancelled():
                    time.sleep(0.01)
                time.sleep(60)
            if action == "wait_cancel":
                deadline = time.time() + 20
                while not request.is_cancelled() and time.time() < deadline:
                    time.sleep(0.01)
                self._mark("cancelled" if request.is_cancelled() else "not-cancelled")
            if action == "hoard":
                self.hoard.append(np.ones(600 << 20, dtype=np.uint8))
                time.sleep(5)
            if action == "whoami":
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("ECHO", np.array(
                    [f"{request.request_id()} {','.join(request.requested_output_names())} "
                     f"{json.loads(request.parameters()).get('flavour', '-')}".encode()],
                    dtype=np.object_))]))
                continue
            if action == "invalid":
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("the action is not valid", pb_utils.TritonError.INVALID_ARG)))
                continue
            if action == "error":
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("plain error")))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("ECHO", np.array([f"{action} from {os.getpid()}".encode()], dtype=np.object_))]))
        return responses

    def finalize(self):
        self._mark("finalize")
