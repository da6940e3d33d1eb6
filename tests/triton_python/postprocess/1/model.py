import json

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.labels = config["parameters"]["labels"]["string_value"].split(",")

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            best = np.argmax(logits, axis=1).astype(np.int64).reshape(-1, 1)
            labels = np.array([[self.labels[i].encode()] for i in best[:, 0]], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("CLASS", best), pb_utils.Tensor("LABEL", labels)]))
        return responses
