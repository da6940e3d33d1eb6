import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT")
            infer_request = pb_utils.InferenceRequest(
                model_name="mlp",
                requested_output_names=["output"],
                inputs=[pb_utils.Tensor("input", x.as_numpy())],
            )
            infer_response = infer_request.exec()
            if infer_response.has_error():
                raise pb_utils.TritonModelException(infer_response.error().message())
            output = pb_utils.get_output_tensor_by_name(infer_response, "output")
            # BLS does not raise on a server-side failure: the response carries the error.
            missing = pb_utils.InferenceRequest(
                model_name="no_such_model", requested_output_names=["y"],
                inputs=[pb_utils.Tensor("x", np.zeros((1, 1), np.float32))]).exec()
            error = missing.error().message() if missing.has_error() else ""
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT", output.as_numpy() * 2.0),
                pb_utils.Tensor("MISSING_ERROR", np.array([error.encode()], dtype=np.object_)),
            ]))
        return responses
