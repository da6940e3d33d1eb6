#!/usr/bin/env python3
"""Writes the ONNX models that Ferrite bundles (models/) and tests against (tests/models/).

Run from the repository root: python3 scripts/make_models.py
The outputs are committed; rerunning this script reproduces them byte for byte (fixed seed).

python3 scripts/make_models.py --tabular DIR writes tabular models into the repository DIR as
their converters write them (scikit-learn through skl2onnx, LightGBM and XGBoost through
onnxmltools, each with its defaults: classifiers end in a ZipMap). The converters are test
dependencies (requirements-test.txt), not the server's; tests/test_tabular.py runs this.

python3 scripts/make_models.py --hugging-face DIR writes an embedder, a cross-encoder and a
classifier into DIR in Hugging Face layout (config.json, tokenizer.json, ...); tests/test_tei.py
runs this.
"""
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPSET = 17
# onnx 1.23 writes IR 14 by default; onnxruntime 1.31 reads up to 13.
IR_VERSION = 9


def save(graph, path):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ferrite")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(model, path)
    print("wrote", os.path.relpath(path, ROOT))


def mlp():
    """input FP32 [N,512] -> Gemm 2048 -> Relu -> Gemm 2048 -> Relu -> Gemm 10 -> output FP32 [N,10]."""
    rng = np.random.default_rng(0)
    sizes = [512, 2048, 2048, 10]
    inits, nodes, prev = [], [], "input"
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        w = (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)
        b = (rng.standard_normal(fan_out) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(sizes) - 2
        out = "output" if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [out if last else f"g{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [out]))
        prev = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 512])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    save(graph, os.path.join(ROOT, "models", "mlp", "1", "model.onnx"))


def mixed():
    """Two inputs of different dtypes, two outputs:
    weighted FP32 [N,4] = values * float(ids); ids_sum INT64 [N,1] = sum(ids, axis 1)."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["values", "ids_f"], ["weighted"]),
        helper.make_node("ReduceSum", ["ids", "axes"], ["ids_sum"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4]),
            helper.make_tensor_value_info("values", TensorProto.FLOAT, ["N", 4]),
        ],
        [
            helper.make_tensor_value_info("weighted", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("ids_sum", TensorProto.INT64, ["N", 1]),
        ],
        [numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
    )
    save(graph, os.path.join(ROOT, "models", "mixed", "1", "model.onnx"))


# V2 datatype -> ONNX element type, for the identity test model.
IDENTITY_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "BF16": TensorProto.BFLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def identity():
    """One Identity per datatype: <dtype>_in [N,3] -> <dtype>_out [N,3] (lower-case names)."""
    ins, outs, nodes = [], [], []
    for name, ty in IDENTITY_TYPES.items():
        n = name.lower()
        ins.append(helper.make_tensor_value_info(f"{n}_in", ty, ["N", 3]))
        outs.append(helper.make_tensor_value_info(f"{n}_out", ty, ["N", 3]))
        nodes.append(helper.make_node("Identity", [f"{n}_in"], [f"{n}_out"]))
    save(helper.make_graph(nodes, "identity", ins, outs), os.path.join(ROOT, "tests", "models", "identity", "1", "model.onnx"))


def fixed():
    """No batch dimension: x FP64 [2,3] -> y = 2x FP64 [2,3]."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])],
    )
    save(graph, os.path.join(ROOT, "tests", "models", "fixed", "1", "model.onnx"))


def ramp_weight(nodes, consts, name, n):
    """Appends nodes computing an [n, n] weight sin(0.37 i) * 1.5 / sqrt(n) into `name` (no initializer
    of that size in the file)."""
    consts += [
        numpy_helper.from_array(np.array(0, np.float32), f"{name}_start"),
        numpy_helper.from_array(np.array(n * n, np.float32), f"{name}_limit"),
        numpy_helper.from_array(np.array(1, np.float32), f"{name}_one"),
        numpy_helper.from_array(np.array(0.37, np.float32), f"{name}_step"),
        numpy_helper.from_array(np.array([n, n], np.int64), f"{name}_shape"),
        numpy_helper.from_array(np.array(1.5 / np.sqrt(n), np.float32), f"{name}_gain"),
    ]
    nodes += [
        helper.make_node("Range", [f"{name}_start", f"{name}_limit", f"{name}_one"], [f"{name}_ramp"]),
        helper.make_node("Mul", [f"{name}_ramp", f"{name}_step"], [f"{name}_angles"]),
        helper.make_node("Sin", [f"{name}_angles"], [f"{name}_wave"]),
        helper.make_node("Reshape", [f"{name}_wave", f"{name}_shape"], [f"{name}_unscaled"]),
        helper.make_node("Mul", [f"{name}_unscaled", f"{name}_gain"], [name]),
    ]


def slow():
    """Deliberately costly per row (a few ms on one core), for load, overload and shutdown tests:
    x FP32 [N,512] -> 1000 times (MatMul by one 512x512 weight, then Tanh) -> y FP32 [N,512].
    The weight is computed in the graph (constant-folded at load), so the file stays small."""
    nodes, consts = [], []
    ramp_weight(nodes, consts, "w", 512)
    prev = "x"
    for i in range(1000):
        nodes.append(helper.make_node("MatMul", [prev, "w"], [f"m{i}"]))
        prev = "y" if i == 999 else f"t{i}"
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [prev]))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 512])],
        consts,
    )
    save(graph, os.path.join(ROOT, "tests", "models", "slow", "1", "model.onnx"))


def scale(path, k, variant="good", input_name="x"):
    """The lifecycle tests' model: x FP32 [N,4] -> y = k x FP32 [N,4]. Variants for canary and reload
    tests: "nan" answers NaN wherever x < 0 (y = kx + 0 sqrt(x)); "slow" adds milliseconds of work
    per row that do not change y; the input may be renamed (an interface change)."""
    consts = [numpy_helper.from_array(np.array(k, np.float32), "k")]
    nodes = [helper.make_node("Mul", [input_name, "k"], ["kx"])]
    if variant == "nan":
        consts.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))
        nodes += [
            helper.make_node("Sqrt", [input_name], ["root"]),
            helper.make_node("Mul", ["root", "zero"], ["nan_or_zero"]),
            helper.make_node("Add", ["kx", "nan_or_zero"], ["y"]),
        ]
    elif variant == "slow":
        ramp_weight(nodes, consts, "w", 512)
        consts += [numpy_helper.from_array(np.array([1, 128], np.int64), "reps"),
                   numpy_helper.from_array(np.array([1], np.int64), "axes"),
                   numpy_helper.from_array(np.array(0, np.float32), "zero")]
        nodes.append(helper.make_node("Tile", [input_name, "reps"], ["h0"]))
        for i in range(400):
            nodes += [helper.make_node("MatMul", [f"h{i}", "w"], [f"m{i}"]),
                      helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"])]
        nodes += [
            helper.make_node("ReduceSum", ["h400", "axes"], ["s"], keepdims=1),
            helper.make_node("Mul", ["s", "zero"], ["nothing"]),
            helper.make_node("Add", ["kx", "nothing"], ["y"]),
        ]
    else:
        nodes[-1] = helper.make_node("Mul", [input_name, "k"], ["y"])
    graph = helper.make_graph(
        nodes,
        "scale",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        consts,
    )
    save(graph, path)


def scales():
    base = os.path.join(ROOT, "tests", "models", "scale")
    for k in (1, 2, 3):
        scale(os.path.join(base, str(k), "model.onnx"), float(k))
    variants = os.path.join(ROOT, "tests", "models", "scale_variants")
    scale(os.path.join(variants, "times5.onnx"), 5.0)
    scale(os.path.join(variants, "nan.onnx"), 2.0, "nan")
    scale(os.path.join(variants, "slow.onnx"), 2.0, "slow")
    scale(os.path.join(variants, "renamed.onnx"), 2.0, input_name="z")

def fpn():
    """A detector-shaped graph with variable H/W: images FP32 [N,1,H,W] -> a stride-2 feature map
    (2x2 average pool) upsampled back (nearest) and concatenated with the input -> maps [N,2,H,W].
    The concat needs H and W even, so a synthetic 1x1 warm-up fails, as a real FPN's does."""
    scale = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scale")
    nodes = [
        helper.make_node("AveragePool", ["images"], ["half"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Resize", ["half", "", "scale"], ["up"], mode="nearest"),
        helper.make_node("Concat", ["images", "up"], ["maps"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "fpn",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 1, "H", "W"])],
        [helper.make_tensor_value_info("maps", TensorProto.FLOAT, ["N", 2, "H", "W"])],
        [scale],
    )
    save(graph, os.path.join(ROOT, "tests", "models", "fpn", "1", "model.onnx"))

def lookup():
    """Where one request's data can fail a whole batch in the backend: ids INT64 [N,2] index a
    [10,3] table (vectors FP32 [N,2,3] = table[ids], table[i] = [i, i, i]; an id outside 0..9 is
    ONNX Runtime's error), text BYTES [N,1] -> text_out (ONNX strings must be UTF-8)."""
    table = numpy_helper.from_array(np.repeat(np.arange(10, dtype=np.float32)[:, None], 3, axis=1), "table")
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["vectors"], axis=0),
        helper.make_node("Identity", ["text"], ["text_out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 2]),
         helper.make_tensor_value_info("text", TensorProto.STRING, ["N", 1])],
        [helper.make_tensor_value_info("vectors", TensorProto.FLOAT, ["N", 2, 3]),
         helper.make_tensor_value_info("text_out", TensorProto.STRING, ["N", 1])],
        [table],
    )
    save(graph, os.path.join(ROOT, "tests", "models", "lookup", "1", "model.onnx"))

def encoder():
    """A text encoder's shape: input_ids and attention_mask INT64 [N,S] with S variable ->
    embedding lookup in a [100,4] table (table[i] = [i, 2i, -i, 0.5i]) -> masked mean over S ->
    embeddings FP32 [N,4]. Ids outside 0..99 are ONNX Runtime's error."""
    i = np.arange(100, dtype=np.float32)
    table = numpy_helper.from_array(np.stack([i, 2 * i, -i, 0.5 * i], axis=1), "table")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    last = numpy_helper.from_array(np.array([2], np.int64), "last")
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["tokens"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"]),
        helper.make_node("Mul", ["tokens", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axes"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask3", "axes"], ["count"], keepdims=0),
        helper.make_node("Div", ["summed", "count"], ["embeddings"]),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "S"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "S"])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["N", 4])],
        [table, axes, last],
    )
    save(graph, os.path.join(ROOT, "tests", "models", "encoder", "1", "model.onnx"))


def tiny_cnn():
    """The bundled image pipeline's classifier: pixels FP32 [N,3,32,32] -> Conv 3x3 (8 channels) ->
    Relu -> GlobalAveragePool -> Flatten -> Gemm 10 -> logits FP32 [N,10]."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) / 5).astype(np.float32), "w")
    b = numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b")
    fc = numpy_helper.from_array((rng.standard_normal((8, 10)) / 2).astype(np.float32), "fc")
    fb = numpy_helper.from_array((rng.standard_normal(10) * 0.1).astype(np.float32), "fb")
    nodes = [
        helper.make_node("Conv", ["pixels", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fb"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_cnn",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [w, b, fc, fb],
    )
    save(graph, os.path.join(ROOT, "models", "tiny_cnn", "1", "model.onnx"))
    labels = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    write(os.path.join(ROOT, "models", "image_classifier", "labels.txt"), "\n".join(labels) + "\n")


WORDS = """the a an and or of to in on at for with from by is are was were be been it this that these those
i you he she we they my your his her our their me him us them what which who where when why how not no yes
do does did have has had can could will would should may might must shall one two three four five six seven
eight nine ten cat cats dog dogs bird fish car cars road city house home tree trees sun moon sky sea water
fire food eat eats ate drink run runs ran walk walks fast slow big small good bad new old red blue green black
white day night time year people man woman child world life hand part place case week work point number
question answer text model server image images fast inference batch token tokens sentence sentences
embedding embeddings search query document documents hello world love like play plays sleep sleeps""".split()


def tokenizer_json(path):
    """A BERT-style WordPiece tokenizer (lower-casing, [CLS] ... [SEP]), built with the tokenizers
    package from a fixed vocabulary, saved as sentence-transformers ship theirs: truncating and
    padding to 128 (a pipeline's tokenize step overrides both)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;()\"")
    vocab = specials + sorted(set(WORDS)) + chars + ["##" + c for c in chars]
    vocab = list(dict.fromkeys(vocab))
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab.index("[CLS]")), ("[SEP]", vocab.index("[SEP]"))])
    tok.decoder = decoders.WordPiece()
    # Registered as special, as BERT's files have them: decoding can skip them.
    tok.add_special_tokens(specials)
    tok.enable_truncation(max_length=128)
    tok.enable_padding(pad_id=0, pad_token="[PAD]", length=128)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)
    print("wrote", os.path.relpath(path, ROOT))
    return len(vocab)


def bert_body(vocab, rng, h=32):
    """A small BERT-shaped encoder: input_ids, attention_mask, token_type_ids INT64 [N,S] ->
    word + position + type embeddings -> LayerNorm -> one masked self-attention block with a
    residual -> LayerNorm -> last_hidden_state FP32 [N,S,h]. Returns (nodes, initializers, inputs)."""
    f = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    inits = [numpy_helper.from_array(v, n) for n, v in [
        ("word", f(vocab, h)), ("pos", f(512, h)), ("type", f(2, h)), ("wq", f(h, h)), ("wk", f(h, h)),
        ("wv", f(h, h)), ("gamma", np.ones(h, np.float32)), ("beta", np.zeros(h, np.float32)),
        ("scale", np.array(1 / np.sqrt(h), np.float32)), ("neg", np.array(-10000.0, np.float32)),
        ("one", np.array(1.0, np.float32)), ("zero", np.array(0, np.int64)), ("step", np.array(1, np.int64)),
        ("dim1", np.array([1], np.int64)), ("ax1", np.array([1], np.int64)),
    ]]
    nodes = [
        helper.make_node("Gather", ["word", "input_ids"], ["we"], axis=0),
        helper.make_node("Gather", ["type", "token_type_ids"], ["te"], axis=0),
        helper.make_node("Shape", ["input_ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "dim1"], ["s1"], axis=0),
        helper.make_node("Squeeze", ["s1"], ["s"]),
        helper.make_node("Range", ["zero", "s", "step"], ["positions"]),
        helper.make_node("Gather", ["pos", "positions"], ["pe"], axis=0),
        helper.make_node("Add", ["we", "te"], ["e1"]),
        helper.make_node("Add", ["e1", "pe"], ["e2"]),
        helper.make_node("LayerNormalization", ["e2", "gamma", "beta"], ["x"], axis=-1),
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "ax1"], ["mask3"]),
        helper.make_node("Sub", ["one", "mask3"], ["inverse"]),
        helper.make_node("Mul", ["inverse", "neg"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["ctx"]),
        helper.make_node("Add", ["x", "ctx"], ["res"]),
        helper.make_node("LayerNormalization", ["res", "gamma", "beta"], ["last_hidden_state"], axis=-1),
    ]
    ints = lambda n: helper.make_tensor_value_info(n, TensorProto.INT64, ["N", "S"])
    return nodes, inits, [ints("input_ids"), ints("attention_mask"), ints("token_type_ids")]


def text_encoder():
    """The bundled text pipeline's encoder (bert_body), last_hidden_state FP32 [N,S,32]."""
    vocab = tokenizer_json(os.path.join(ROOT, "models", "text_embedder", "tokenizer.json"))
    nodes, inits, inputs = bert_body(vocab, np.random.default_rng(2))
    graph = helper.make_graph(
        nodes, "text_encoder", inputs,
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["N", "S", 32])], inits)
    save(graph, os.path.join(ROOT, "models", "text_encoder", "1", "model.onnx"))


def hugging_face(repo):
    """Four models in Hugging Face layout, as optimum and sentence-transformers write them, for
    the TEI tests: `hf_embedder` (BertModel, mean pooling in 1_Pooling/, max_seq_length 24, a
    `query` prompt, onnx/model.onnx: the bundled encoder), `hf_reranker` (a cross-encoder:
    BertForSequenceClassification with one label, logits FP32 [N,1] from the [CLS] token),
    `hf_classifier` (three labels in id2label, logits FP32 [N,3]) and `hf_splade` (a SPLADE model:
    BertForMaskedLM, logits FP32 [N,S,vocab])."""
    import json
    import shutil

    def write_json(path, value):
        write(path, json.dumps(value, indent=2))

    vocab = tokenizer_json(os.path.join(repo, "hf_embedder", "tokenizer.json"))
    write_json(os.path.join(repo, "hf_embedder", "config.json"),
               {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "max_position_embeddings": 512})
    write_json(os.path.join(repo, "hf_embedder", "sentence_bert_config.json"), {"max_seq_length": 24, "do_lower_case": False})
    write_json(os.path.join(repo, "hf_embedder", "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
    write_json(os.path.join(repo, "hf_embedder", "1_Pooling", "config.json"),
               {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False})
    write_json(os.path.join(repo, "hf_embedder", "config_sentence_transformers.json"),
               {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None})
    os.makedirs(os.path.join(repo, "hf_embedder", "onnx"), exist_ok=True)
    shutil.copy(os.path.join(ROOT, "models", "text_encoder", "1", "model.onnx"),
                os.path.join(repo, "hf_embedder", "onnx", "model.onnx"))
    # A SPLADE model: BertForMaskedLM, logits FP32 [N,S,vocab] (a dense head with a negative bias,
    # so most entries of a text's vector are 0 after log(1 + relu)).
    rng = np.random.default_rng(7)
    nodes, inits, inputs = bert_body(vocab, rng)
    inits += [numpy_helper.from_array((rng.standard_normal((32, vocab)) * 0.3).astype(np.float32), "mlm_head"),
              numpy_helper.from_array(np.full(vocab, -4.0, np.float32), "mlm_bias")]
    nodes += [helper.make_node("MatMul", ["last_hidden_state", "mlm_head"], ["mlm"]),
              helper.make_node("Add", ["mlm", "mlm_bias"], ["logits"])]
    graph = helper.make_graph(nodes, "hf_splade", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", "S", vocab])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ferrite")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    os.makedirs(os.path.join(repo, "hf_splade", "onnx"), exist_ok=True)
    onnx.save(model, os.path.join(repo, "hf_splade", "onnx", "model.onnx"))
    shutil.copy(os.path.join(repo, "hf_embedder", "tokenizer.json"), os.path.join(repo, "hf_splade", "tokenizer.json"))
    write_json(os.path.join(repo, "hf_splade", "config.json"), {
        "architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": vocab, "max_position_embeddings": 512})
    for name, labels, seed in [("hf_reranker", ["LABEL_0"], 5), ("hf_classifier", ["negative", "neutral", "positive"], 6)]:
        rng = np.random.default_rng(seed)
        nodes, inits, inputs = bert_body(vocab, rng)
        k = len(labels)
        inits += [numpy_helper.from_array((rng.standard_normal((32, k)) * 2).astype(np.float32), "head"),
                  numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "head_bias"),
                  numpy_helper.from_array(np.array([0], np.int64), "first")]
        nodes += [helper.make_node("Gather", ["last_hidden_state", "first"], ["cls3"], axis=1),
                  helper.make_node("Squeeze", ["cls3", "ax1"], ["cls"]),
                  helper.make_node("MatMul", ["cls", "head"], ["projected"]),
                  helper.make_node("Add", ["projected", "head_bias"], ["logits"])]
        graph = helper.make_graph(nodes, name, inputs,
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", k])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ferrite")
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        os.makedirs(os.path.join(repo, name), exist_ok=True)
        onnx.save(model, os.path.join(repo, name, "model.onnx"))
        shutil.copy(os.path.join(repo, "hf_embedder", "tokenizer.json"), os.path.join(repo, name, "tokenizer.json"))
        write_json(os.path.join(repo, name, "config.json"), {
            "architectures": ["BertForSequenceClassification"], "model_type": "bert", "max_position_embeddings": 512,
            "id2label": {str(i): l for i, l in enumerate(labels)}, "label2id": {l: i for i, l in enumerate(labels)}})


def detector(layout):
    """A detector's output layout for the NMS tests: images FP32 [N,3,H,W] -> output0, YOLOv8's
    [N, 4+3, 6] (cx, cy, w, h, then a score per class) or YOLOv5's [N, 6, 5+3] (with objectness).
    Boxes are fixed (in the pixels of a 64x64 input; two of class 0 overlap, one of class 1
    overlaps them); scores are sigmoid(bias + 4 * mean(image)), so brighter images score higher."""
    boxes = np.array([[20, 20, 16, 16], [21, 21, 16, 16], [22, 20, 16, 16], [48, 48, 10, 10], [10, 50, 8, 6],
                      [40, 12, 12, 12]], np.float32).T.reshape(1, 4, 6)
    bias = np.array([[2.0, 1.5, -3.0, 1.0, -0.5, -4.0], [-4.0, -3.0, 1.8, -4.0, -4.0, 0.5],
                     [-4.0, -4.0, -4.0, -1.0, 0.2, -4.0]], np.float32).reshape(1, 3, 6)
    inits = [numpy_helper.from_array(boxes, "boxes"), numpy_helper.from_array(bias, "bias"),
             numpy_helper.from_array(np.array(4.0, np.float32), "gain"),
             numpy_helper.from_array(np.zeros((1, 1, 6), np.float32), "zeros"),
             numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "to3")]
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["m4"], axes=[1, 2, 3], keepdims=1),  # [N,1,1,1]
        helper.make_node("Reshape", ["m4", "to3"], ["m"]),  # [N,1,1]
        helper.make_node("Mul", ["m", "gain"], ["mg"]),
        helper.make_node("Add", ["mg", "bias"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["scores"]),  # [N,3,6]
        helper.make_node("Mul", ["m", "zeros"], ["nz"]),  # [N,1,6] zeros
        helper.make_node("Add", ["nz", "boxes"], ["b"]),  # [N,4,6]
    ]
    if layout == "v8":
        nodes.append(helper.make_node("Concat", ["b", "scores"], ["output0"], axis=1))
        shape = ["N", 7, 6]
    else:
        inits.append(numpy_helper.from_array(np.array(0.9, np.float32), "objectness"))
        nodes += [
            helper.make_node("Add", ["nz", "objectness"], ["obj"]),
            helper.make_node("Concat", ["b", "obj", "scores"], ["fields"], axis=1),
            helper.make_node("Transpose", ["fields"], ["output0"], perm=[0, 2, 1]),
        ]
        shape = ["N", 6, 8]
    graph = helper.make_graph(
        nodes, f"detector_{layout}",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, shape)], inits)
    save(graph, os.path.join(ROOT, "tests", "models", f"yolo_{layout}", "1", "model.onnx"))


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print("wrote", os.path.relpath(path, ROOT))


def tabular(repo):
    """Classifiers and a regressor on 4 features, trained on a fixed synthetic set, converted with
    their converters' defaults into `repo/<name>/1/model.onnx`."""
    import lightgbm
    import onnxmltools
    import xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType as MlFloat
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(7)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    classes = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(int) + (x[:, 2] > 0.8).astype(int)
    names = np.array(["bird", "cat", "dog"])[classes]
    opset = {"": OPSET, "ai.onnx.ml": 3}
    features = [("input", FloatTensorType([None, 4]))]
    models = {
        "forest": to_onnx(RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0).fit(x, classes),
                          initial_types=features, target_opset=opset),
        "scaled_logreg": to_onnx(make_pipeline(StandardScaler(), LogisticRegression()).fit(x, names),
                                 initial_types=features, target_opset=opset),
        "boosted_regressor": to_onnx(GradientBoostingRegressor(n_estimators=20, random_state=0).fit(x, x[:, 0] * 2 + x[:, 3]),
                                     initial_types=features, target_opset=opset),
        "lightgbm": onnxmltools.convert_lightgbm(
            lightgbm.LGBMClassifier(n_estimators=20, num_leaves=8, random_state=0, verbose=-1).fit(x, classes),
            initial_types=[("input", MlFloat([None, 4]))], target_opset=15),
        "xgboost": onnxmltools.convert_xgboost(
            xgboost.XGBClassifier(n_estimators=20, max_depth=3, random_state=0).fit(x, classes),
            initial_types=[("input", MlFloat([None, 4]))], target_opset=15),
    }
    for name, model in models.items():
        model.ir_version = min(model.ir_version, IR_VERSION)
        path = os.path.join(repo, name, "1", "model.onnx")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        onnx.save(model, path)
        print("wrote", path)


if __name__ == "__main__" and sys.argv[1:2] == ["--tabular"]:
    tabular(sys.argv[2])
elif __name__ == "__main__" and sys.argv[1:2] == ["--hugging-face"]:
    hugging_face(sys.argv[2])
elif __name__ == "__main__":
    mlp()
    mixed()
    identity()
    fixed()
    slow()
    scales()
    fpn()
    lookup()
    encoder()
    tiny_cnn()
    text_encoder()
    detector("v8")
    detector("v5")
