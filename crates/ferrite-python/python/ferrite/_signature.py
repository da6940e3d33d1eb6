"""Typed signatures generated from a model's metadata: dataclasses for its inputs and outputs
(validated on construction, with the server's messages), and Pydantic models for JSON bodies.

Field names: a tensor name becomes a Python identifier by one rule, applied character by
character: ASCII letters, digits and "_" are kept; any other character becomes "_" + its code
point in lowercase hex (at least two digits) + "_" ("sigmoid_0.tmp_0" -> "sigmoid_0_2e_tmp_0",
"input:0" -> "input_3a_0"); a name that then starts with a digit gets "t_" in front; a Python
keyword gets "_" behind; should two tensors still meet on one name, the later one gets "_2",
"_3", ... The original name is kept for every field (`Signature.tensor_name`, and each field's
`metadata["tensor"]`), so the mapping is reversible whatever the names are.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

import numpy as np
import numpy.typing as npt

from ._native import InvalidInput

# V2 datatype -> NumPy dtype (BYTES: object arrays of bytes or str).
DTYPES: Dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BF16": np.float32,
    "BYTES": np.object_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k not in ("BF16", "BYTES")}


def field_name(tensor: str) -> str:
    """The identifier the module's rule gives `tensor` (before collisions are resolved)."""
    out = []
    for ch in tensor:
        if ch.isascii() and (ch.isalnum() or ch == "_"):
            out.append(ch)
        else:
            out.append(f"_{ord(ch):02x}_")
    name = "".join(out) or "_"
    if name[0].isdigit():
        name = "t_" + name
    if keyword.iskeyword(name):
        name += "_"
    return name


def datatype_of(a: np.ndarray) -> str:
    """The V2 datatype of an array (BYTES for bytes, str and object arrays)."""
    name = _NAMES.get(a.dtype)
    if name is not None:
        return name
    return "BYTES" if a.dtype.kind in ("O", "S", "U") else str(a.dtype)


def _fits(shape: Tuple[int, ...], expected: Tuple[int, ...]) -> bool:
    return len(shape) == len(expected) and all(e < 0 or d == e for d, e in zip(shape, expected))


def check(kind: str, tensor: str, value: Any, datatype: str, shape: Tuple[int, ...]) -> None:
    """Raises the server's error for a value that is not an array of the tensor's datatype and shape."""
    if not isinstance(value, np.ndarray):
        raise InvalidInput(f"{kind} '{tensor}': expected a numpy array of {datatype}, got {type(value).__name__}")
    got = datatype_of(value)
    if got != datatype and not (datatype == "BF16" and got == "FP32"):
        raise InvalidInput(f"{kind} '{tensor}': expected datatype {datatype}, got {got}")
    if not _fits(value.shape, shape):
        raise InvalidInput(f"{kind} '{tensor}': expected shape {list(shape)}, got {list(value.shape)}")


def _text(v: Any) -> Any:
    """Nested lists with bytes elements (BYTES outputs) as str, for JSON."""
    if isinstance(v, list):
        return [_text(x) for x in v]
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


class Signature:
    """A model's typed signature: `Inputs` and `Outputs` dataclasses, one field per tensor."""

    def __init__(self, model_name: str, inputs: Sequence[Any], outputs: Sequence[Any], optional: Sequence[str]) -> None:
        self.model_name = model_name
        self._tensor: Dict[str, str] = {}
        stem = "".join(p[:1].upper() + p[1:] for p in re.split(r"[^0-9A-Za-z]+", model_name) if p) or "Model"
        if stem[0].isdigit():
            stem = "Model" + stem
        self.Inputs: Type[Any] = self._make(f"{stem}Inputs", inputs, set(optional), "input", validate=True)
        self.Outputs: Type[Any] = self._make(f"{stem}Outputs", outputs, set(), "output", validate=False)
        self._output_fields: Tuple[Tuple[str, str], ...] = self.Outputs.__ferrite_fields__

    def tensor_name(self, field: str) -> str:
        """The tensor a field stands for."""
        return self._tensor[field]

    def _make(self, cls_name: str, specs: Sequence[Any], optional: set, kind: str, validate: bool) -> Type[Any]:
        taken: Dict[str, str] = {}
        fields: List[Tuple[str, Any, Any]] = []
        pairs: List[Tuple[str, str]] = []
        checks: List[Tuple[str, str, str, Tuple[int, ...]]] = []
        required = [s for s in specs if s.name not in optional] + [s for s in specs if s.name in optional]
        for spec in required:
            base = field_name(spec.name)
            name, n = base, 1
            while name in taken:
                n += 1
                name = f"{base}_{n}"
            taken[name] = spec.name
            self._tensor.setdefault(name, spec.name)
            annotation = npt.NDArray[DTYPES.get(spec.datatype, np.generic)]
            meta = {"tensor": spec.name, "datatype": spec.datatype, "shape": tuple(spec.shape)}
            if spec.name in optional:
                fields.append((name, Optional[annotation], dataclasses.field(default=None, metadata=meta)))
            else:
                fields.append((name, annotation, dataclasses.field(metadata=meta)))
            pairs.append((name, spec.name))
            checks.append((name, spec.name, spec.datatype, tuple(spec.shape)))

        def __post_init__(self: Any) -> None:
            for field, tensor, datatype, shape in checks:
                value = getattr(self, field)
                if value is not None or tensor not in optional:
                    check(kind, tensor, value, datatype, shape)

        namespace: Dict[str, Any] = {"__ferrite_fields__": tuple(pairs)}
        if validate:
            namespace["__post_init__"] = __post_init__
        cls = dataclasses.make_dataclass(cls_name, fields, frozen=True, namespace=namespace)
        cls.__module__ = "ferrite.signatures"
        cls.__doc__ = f"The {kind}s of model '{self.model_name}': " + ", ".join(
            f"{f} = tensor '{t}'" for f, t in pairs
        )
        return cls

    def to_tensors(self, inputs: Any) -> Dict[str, Any]:
        """An `Inputs` instance as the dict `Model.infer` takes (optional inputs left out when None)."""
        return _by_tensor(self.Inputs.__ferrite_fields__, inputs)

    def outputs(self, tensors: Mapping[str, Any]) -> Any:
        """The outputs dict of a request as an `Outputs` instance (the engine's arrays, not copied)."""
        obj = object.__new__(self.Outputs)
        obj.__dict__.update({field: tensors.get(tensor) for field, tensor in self._output_fields})
        return obj

    def pydantic_models(self, metadata: Any) -> Tuple[Type[Any], Type[Any]]:
        """(Request, Response) Pydantic v2 models for JSON bodies: each input as nested lists or a
        V2 tensor object (`{"shape", "datatype", "data"}`), validated against the model's datatype
        and shape (a FastAPI route answers 422 with the reason); `Request.to_inputs()` gives the
        dict `Model.infer` takes, `Response.from_outputs(outputs)` the body to return."""
        try:
            import pydantic
        except ImportError as e:  # pragma: no cover - the optional dependency is missing
            raise ImportError("pydantic_models() needs Pydantic v2: pip install 'pydantic>=2'") from e
        from typing import Annotated, Union

        def nested(datatype: str, rank: int) -> Any:
            leaf: Any = {"BOOL": bool, "BYTES": str, "FP16": float, "FP32": float, "FP64": float, "BF16": float}.get(
                datatype, int
            )
            for _ in range(rank):
                leaf = List[leaf]  # type: ignore[valid-type]
            return leaf

        class V2Tensor(pydantic.BaseModel):
            shape: List[int]
            datatype: str
            data: List[Any]

        def converter(tensor: str, datatype: str, shape: Tuple[int, ...]) -> Any:
            def convert(value: Any) -> Any:
                if isinstance(value, V2Tensor):
                    if value.datatype != datatype:
                        raise ValueError(f"input '{tensor}': expected datatype {datatype}, got {value.datatype}")
                    array = np.asarray(value.data, dtype=DTYPES[datatype]).reshape(value.shape)
                else:
                    try:
                        array = np.asarray(value, dtype=DTYPES[datatype])
                    except (ValueError, TypeError) as e:
                        raise ValueError(f"input '{tensor}': not a rectangular array of {datatype} ({e})") from e
                if not _fits(array.shape, shape):
                    raise ValueError(f"input '{tensor}': expected shape {list(shape)}, got {list(array.shape)}")
                return array

            return convert

        fields: Dict[str, Any] = {}
        for spec in metadata.inputs:
            field = next(f for f, t in self.Inputs.__ferrite_fields__ if t == spec.name)
            kind = Union[nested(spec.datatype, len(spec.shape)), V2Tensor]
            typed = Annotated[kind, pydantic.AfterValidator(converter(spec.name, spec.datatype, tuple(spec.shape)))]
            default = None if self.Inputs.__dataclass_fields__[field].default is None else ...
            fields[field] = (Optional[typed] if default is None else typed, pydantic.Field(default, alias=spec.name))
        signature = self

        class RequestBase(pydantic.BaseModel):
            model_config = pydantic.ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

            def to_inputs(self) -> Dict[str, Any]:
                return _by_tensor(signature.Inputs.__ferrite_fields__, self)

        stem = self.Inputs.__name__[: -len("Inputs")]
        request = pydantic.create_model(f"{stem}Request", __base__=RequestBase, **fields)
        out_fields: Dict[str, Any] = {}
        for spec in metadata.outputs:
            field = next(f for f, t in self.Outputs.__ferrite_fields__ if t == spec.name)
            out_fields[field] = (nested(spec.datatype, len(spec.shape)), pydantic.Field(..., alias=spec.name))

        class ResponseBase(pydantic.BaseModel):
            model_config = pydantic.ConfigDict(populate_by_name=True)

            @classmethod
            def from_outputs(cls, outputs: Mapping[str, Any]) -> Any:
                values = {}
                for f, t in signature.Outputs.__ferrite_fields__:
                    v = outputs[t]
                    if isinstance(v, np.ndarray):
                        v = v.tolist()
                    values[f] = _text(v)
                return cls(**values)

        response = pydantic.create_model(f"{stem}Response", __base__=ResponseBase, **out_fields)
        return request, response


def _by_tensor(pairs: Tuple[Tuple[str, str], ...], obj: Any) -> Dict[str, Any]:
    """`obj`'s fields keyed by the tensors they stand for; fields left None are left out."""
    return {tensor: value for field, tensor in pairs if (value := getattr(obj, field)) is not None}
