"""The V2 JSON request body as the baselines validate it (Pydantic), as a Python team writes it."""

from pydantic import BaseModel


class Tensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[float]


class InferRequest(BaseModel):
    inputs: list[Tensor]
