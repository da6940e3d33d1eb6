"""Checks YAML documents against KServe's generated models of its CRDs (and the Kubernetes
client's, for the pod fields they embed): every key a field of its type, every value of the
field's type, recursively. `python kserve_models.py FILE TYPE [FILE TYPE ...]`; prints each
problem and exits 1 if any. Run in a process of its own by test_deploy.py (kserve's gRPC stubs and
tritonclient's cannot be imported into one process)."""

import sys

import kserve
import kubernetes.client
import yaml

SIMPLE = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object, "datetime": str}


def check(value, type_name, where, problems):
    # The generators spell containers list[T] / List[T] and dict(K, V) / Dict[K, V].
    type_name = type_name.strip()
    if type_name.startswith("Optional["):
        type_name = type_name[9:-1]
    if type_name.startswith("List["):
        type_name = "list[" + type_name[5:]
    if type_name.startswith("Dict["):
        type_name = "dict(" + type_name[5:-1] + ")"
    if type_name.startswith("list["):
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list")
            return
        for i, v in enumerate(value):
            check(v, type_name[5:-1], f"{where}[{i}]", problems)
        return
    if type_name.startswith("dict("):
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a map")
            return
        inner = type_name[5:-1].split(", ", 1)[1]
        for k, v in value.items():
            check(v, inner, f"{where}.{k}", problems)
        return
    if type_name in SIMPLE:
        if not isinstance(value, SIMPLE[type_name]):
            problems.append(f"{where}: expected {type_name}, got {value!r}")
        return
    cls = getattr(kserve, type_name, None) or getattr(kubernetes.client, type_name)
    if not isinstance(value, dict):
        problems.append(f"{where}: expected a {type_name} object")
        return
    fields = {json_name: py for py, json_name in cls.attribute_map.items()}
    for k, v in value.items():
        if k not in fields:
            problems.append(f"{where}: {k!r} is not a field of {type_name}")
            continue
        check(v, cls.openapi_types[fields[k]], f"{where}.{k}", problems)


if __name__ == "__main__":
    problems = []
    args = sys.argv[1:]
    for path, type_name in zip(args[::2], args[1::2]):
        for doc in yaml.safe_load_all(open(path)):
            if doc:
                check(doc, type_name, f"{path}:{doc.get('kind')}", problems)
    for p in problems:
        print(p)
    sys.exit(1 if problems else 0)
