import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [2]})
        auto_complete_model_config.add_output({"name": "Y", "data_type": "TYPE_INT32", "dims": [2]})
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    async def execute(self, requests):
        # An async execute (Triton's way to await BLS calls): awaited by the worker.
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            mlp = await pb_utils.InferenceRequest(
                model_name="mlp", requested_output_names=["output"],
                inputs=[pb_utils.Tensor("input", np.zeros((1, 512), np.float32))]).async_exec()
            assert pb_utils.get_output_tensor_by_name(mlp, "output").as_numpy().shape == (1, 10)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", x * 3)]))
        return responses
