#!/usr/bin/env python3
"""Writes the benchmark's models of the kinds users serve, made locally (no downloads, fixed seed),
into a model repository: bench/.work/kinds/<name>/1/model.onnx.

- mlp:      512 -> 2048 -> 2048 -> 10 (overhead-bound; the bundled example model)
- tiny:     [N,16] -> Gemm 16 -> Relu (all overhead)
- resnet:   a ResNet-style CNN at 3x224x224 (stem, 4 stages of residual blocks, pool, FC 1000)
- detector: a detector-style CNN with variable H/W (backbone, FPN-like upsample + concat, a DB-like
            head), served at 320 and 640
- bert:     a BERT-style encoder (6 layers, hidden 384, 6 heads, FFN 1536), INT64 input_ids and
            attention_mask [N,128] -> last hidden state [N,128,384]; bert_var the same at any length
            (the text pipeline's model: rows padded to the longest of each batch)

Usage: python3 bench/make_models.py [OUT_DIR]
"""
import os
import shutil
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPSET = 17
IR_VERSION = 9  # onnxruntime 1.31 reads up to IR 13; onnx 1.23 writes 14 by default


class Graph:
    """A small builder: nodes and initializers with generated names."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, prefix):
        self.n += 1
        return f"{prefix}{self.n}"

    def const(self, array, prefix="c"):
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, shape, fan_in):
        return self.const((self.rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), "w")

    def op(self, op_type, inputs, **attrs):
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def conv(self, x, cin, cout, k=3, stride=1, relu=True):
        w = self.weight((cout, cin, k, k), cin * k * k)
        b = self.const(np.zeros(cout, np.float32), "b")
        y = self.op("Conv", [x, w, b], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4)
        return self.op("Relu", [y]) if relu else y

    def linear(self, x, fan_in, fan_out):
        w = self.weight((fan_in, fan_out), fan_in)
        b = self.const(np.zeros(fan_out, np.float32), "b")
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def save(self, inputs, outputs, path):
        graph = helper.make_graph(self.nodes, os.path.basename(os.path.dirname(os.path.dirname(path))),
                                  inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ferrite-bench")
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        onnx.save(model, path)
        print("wrote", path, f"({os.path.getsize(path) >> 10} KiB)")


def rename_output(g, last, name):
    """Names the graph's output: `last`, which the most recent node produced."""
    assert g.nodes[-1].output[0] == last
    g.nodes[-1].output[0] = name


def tiny(path):
    g = Graph(1)
    y = g.op("Relu", [g.linear("input", 16, 16)])
    rename_output(g, y, "output")
    g.save([helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 16])],
           [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 16])], path)


def resnet(path):
    g = Graph(2)
    x = g.conv("images", 3, 32, k=7, stride=2)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 32
    for cout, blocks in [(32, 2), (64, 2), (128, 2), (256, 2)]:
        for b in range(blocks):
            stride = 2 if b == 0 and cout != 32 else 1
            y = g.conv(x, cin, cout, stride=stride)
            y = g.conv(y, cout, cout, relu=False)
            skip = x if stride == 1 and cin == cout else g.conv(x, cin, cout, k=1, stride=stride, relu=False)
            x = g.op("Relu", [g.op("Add", [y, skip])])
            cin = cout
    x = g.op("GlobalAveragePool", [x])
    x = g.op("Flatten", [x], axis=1)
    y = g.linear(x, 256, 1000)
    rename_output(g, y, "logits")
    g.save([helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 224, 224])],
           [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 1000])], path)


def detector(path):
    """Backbone at strides 4/8/16/32, each level reduced to 32 channels, upsampled to stride 4 and
    concatenated (FPN/DB-style), then a head giving a 1-channel probability map at stride 4. The
    concat needs every level to line up: H and W must be multiples of 32, so a 1x1 warm-up fails."""
    g = Graph(3)
    x = g.conv("images", 3, 16, stride=2)
    levels, cin = [], 16
    for cout in (24, 48, 96, 192):
        x = g.conv(x, cin, cout, stride=2)
        x = g.conv(x, cout, cout)
        levels.append((x, cout))
        cin = cout
    ups = []
    for i, (feat, c) in enumerate(levels):
        y = g.conv(feat, c, 32, k=1)
        if i:
            scale = g.const(np.array([1, 1, 2 ** i, 2 ** i], np.float32), "scale")
            y = g.op("Resize", [y, "", scale], mode="nearest")
        ups.append(y)
    x = g.op("Concat", ups, axis=1)
    x = g.conv(x, 128, 32)
    y = g.op("Sigmoid", [g.conv(x, 32, 1, k=1, relu=False)])
    rename_output(g, y, "maps")
    g.save([helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, "H", "W"])],
           [helper.make_tensor_value_info("maps", TensorProto.FLOAT, ["N", 1, "H4", "W4"])], path)


def yolo(path):
    """YOLOv8n's output layout at about its size (2.4 M weights to its 3.2 M): images [N,3,H,W] ->
    output0 [N, 84, anchors], 8400 anchors at 640x640. A backbone at strides 2-32 with two 3x3 convs a
    level, a head per level at strides 8, 16 and 32 (3x3 conv, then 1x1 to 4 box + 80 class
    channels), flattened and concatenated along the anchors. Not YOLOv8's blocks, only its scale."""
    g = Graph(4)
    x = g.conv("images", 3, 16, stride=2)
    levels, cin = [], 16
    for cout in (32, 64, 128, 256):
        x = g.conv(x, cin, cout, stride=2)
        x = g.conv(g.conv(x, cout, cout), cout, cout)
        levels.append((x, cout))
        cin = cout
    heads = []
    for feat, c in levels[1:]:
        y = g.conv(g.conv(feat, c, 96), 96, 84, k=1, relu=False)
        heads.append(g.op("Reshape", [y, g.const(np.array([0, 84, -1], np.int64), "shape")]))
    y = g.op("Sigmoid", [g.op("Concat", heads, axis=2)])
    rename_output(g, y, "output0")
    g.save([helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, "H", "W"])],
           [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", 84, "A"])], path)


def bert(path, layers=6, hidden=384, heads=6, ffn=1536, vocab=30522, seq=128, labels=None, pairs=False):
    """`seq` None: any sequence length up to 512 (positions gathered for the length given).
    `labels`: a sequence classifier (a cross-encoder with 1), the [CLS] token through a linear
    head to logits [N, labels]; `pairs`: it also reads token_type_ids (the second text's)."""
    g = Graph(4)
    head = hidden // heads
    emb = g.const((g.rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float32), "emb")
    if seq is None:
        table = g.const((g.rng.standard_normal((512, hidden)) * 0.02).astype(np.float32), "pos")
        length = g.op("Squeeze", [g.op("Gather", [g.op("Shape", ["input_ids"]), g.const(np.array([1], np.int64))], axis=0)])
        positions = g.op("Range", [g.const(np.array(0, np.int64)), length, g.const(np.array(1, np.int64))])
        pos = g.op("Gather", [table, positions], axis=0)
    else:
        pos = g.const((g.rng.standard_normal((1, seq, hidden)) * 0.02).astype(np.float32), "pos")
    x = g.op("Add", [g.op("Gather", [emb, "input_ids"], axis=0), pos])
    if pairs:
        types = g.const((g.rng.standard_normal((2, hidden)) * 0.02).astype(np.float32), "types")
        x = g.op("Add", [x, g.op("Gather", [types, "token_type_ids"], axis=0)])

    def norm(x):
        return g.op("LayerNormalization", [x, g.const(np.ones(hidden, np.float32)), g.const(np.zeros(hidden, np.float32))],
                    axis=-1, epsilon=1e-12)

    x = norm(x)
    # Additive mask: 0 where attended, -10000 where padded; [N,1,1,S].
    mask = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    mask = g.op("Mul", [g.op("Sub", [g.const(np.float32(1.0)), mask]), g.const(np.float32(-10000.0))])
    mask = g.op("Unsqueeze", [mask, g.const(np.array([1, 2], np.int64))])
    split = g.const(np.array([0, seq or -1, heads, head], np.int64), "shape")
    merge = g.const(np.array([0, seq or -1, hidden], np.int64), "shape")
    scale = g.const(np.float32(1.0 / np.sqrt(head)))
    for _ in range(layers):
        def heads_of(t):
            return g.op("Transpose", [g.op("Reshape", [t, split])], perm=[0, 2, 1, 3])

        q, k, v = (heads_of(g.linear(x, hidden, hidden)) for _ in range(3))
        scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), scale])
        probs = g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1)
        ctx = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3]), merge])
        x = norm(g.op("Add", [x, g.linear(ctx, hidden, hidden)]))
        h = g.linear(x, hidden, ffn)
        # GELU (erf form).
        h = g.op("Mul", [g.op("Mul", [h, g.const(np.float32(0.5))]),
                         g.op("Add", [g.op("Erf", [g.op("Div", [h, g.const(np.float32(np.sqrt(2.0)))])]),
                                      g.const(np.float32(1.0))])])
        x = norm(g.op("Add", [x, g.linear(h, ffn, hidden)]))
    s = seq or "S"
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", s]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", s])]
    if pairs:
        inputs.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["N", s]))
    if labels:
        cls = g.op("Squeeze", [g.op("Gather", [x, g.const(np.array([0], np.int64))], axis=1), g.const(np.array([1], np.int64))])
        logits = g.op("Add", [g.op("MatMul", [cls, g.weight((hidden, labels), hidden)]),
                              g.const((g.rng.standard_normal(labels)).astype(np.float32), "b")])
        rename_output(g, logits, "logits")
        g.save(inputs, [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", labels])], path)
        return
    rename_output(g, x, "last_hidden_state")
    g.save(inputs, [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["N", s, hidden])], path)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench", ".work", "kinds")
    model = lambda name: os.path.join(out, name, "1", "model.onnx")  # noqa: E731
    os.makedirs(os.path.join(out, "mlp", "1"), exist_ok=True)
    shutil.copy(os.path.join(ROOT, "models", "mlp", "1", "model.onnx"), model("mlp"))
    tiny(model("tiny"))
    resnet(model("resnet"))
    detector(model("detector"))
    yolo(model("yolo"))
    bert(model("bert"))
    bert(model("bert_var"), seq=None)
    bert(model("bert_rerank"), seq=None, labels=1, pairs=True)
    bert(model("bert_classify"), seq=None, labels=3)


if __name__ == "__main__":
    main()
