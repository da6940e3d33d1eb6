import io

import numpy as np
from PIL import Image

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            pixels = []
            for encoded in images.reshape(-1):
                img = Image.open(io.BytesIO(encoded)).convert("RGB").resize((32, 32), Image.BILINEAR)
                x = np.asarray(img, dtype=np.float32) / 255.0
                pixels.append(x.transpose(2, 0, 1))
            out = pb_utils.Tensor("PIXELS", np.stack(pixels).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
