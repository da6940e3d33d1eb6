"""Texts of many lengths in one batch, in-process (bench/run.sh --text-lengths): what padding
costs a text encoder when a batch's rows are padded to its longest, and what grouping rows of near
lengths gives back, for the bound the tokenize step uses (`PAD_WASTE` in
crates/ferrite-core/src/pipeline/text.rs). Two encoders: one of all-MiniLM-L6-v2's size
(bench/make_models.py's `bert_var`, 6 layers x 384) and the bundled small `text_encoder`.

The texts are bench/pipelines.py's `mixed_sentences` (5 to 150 tokens, most short), taken in
order in batches of 8 and 32 (what a pipeline worker gets at 32 and 128 clients). Each batch is
tokenized, its rows sorted by length and cut into groups as the tokenize step cuts them (each
group as long as padding its rows to its longest adds at most `waste` of their own tokens), and
each group run as one call. `waste` = inf is one call padded to the batch's longest (the step
before groups); batch 1 is each text alone (no padding). ONNX Runtime on both cores, as the
server's solo instance runs.

Writes bench/results/text-lengths.md. Usage: python3 bench/text_lengths.py [--secs 3]
"""

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.pipelines as pipelines  # noqa: E402
from bench.run import RESULTS, ROOT, WORK  # noqa: E402

WASTES = (0.0, 0.1, 0.25, 0.5, 1.0, math.inf)
PAD_WASTE = 0.25  # the tokenize step's bound (`PAD_WASTE` in text.rs)


def groups(lengths, waste):
    """Row indices in groups, as `padded_lengths` in text.rs forms them."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, group, tokens = [], [], 0
    for i in order:
        n = max(1, lengths[i])
        if group and (len(group) + 1) * n > (1 + waste) * (tokens + n):
            out.append(group)
            group, tokens = [], 0
        group.append(i)
        tokens += n
    if group:
        out.append(group)
    return out


def feed(enc, group, names=("input_ids", "attention_mask")):
    """The inputs of one run: the group's rows of `enc` padded to its longest (0 as the pad id,
    as the bench tokenizer's), for the model inputs `names`."""
    longest = max(len(enc[g].ids) for g in group)
    pad = lambda row: row + [0] * (longest - len(row))  # noqa: E731
    ids = np.array([pad(enc[g].ids) for g in group], np.int64)
    out = {"input_ids": ids, "attention_mask": np.array([pad(enc[g].attention_mask) for g in group], np.int64)}
    if "token_type_ids" in names:
        out["token_type_ids"] = np.zeros_like(ids)
    return out


# The encoders measured: the bench's of all-MiniLM-L6-v2's size, and the bundled small one (where
# a run's fixed cost weighs more against its tokens).
MODELS = {"MiniLM-sized encoder (bench `bert_var`)": WORK / "kinds" / "bert_var" / "1" / "model.onnx",
          "small encoder (bundled `text_encoder`)": ROOT / "models" / "text_encoder" / "1" / "model.onnx"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--secs", type=float, default=3.0)
    args = ap.parse_args()
    import onnxruntime as ort
    from tokenizers import Tokenizer

    pipelines.repository()  # the bench models, made once
    tok = Tokenizer.from_file(str(pipelines.TOKENIZER))
    tok.no_padding()
    tok.enable_truncation(256)  # the pipeline's max_length
    texts = pipelines.mixed_sentences()
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    lines = [
        "# Texts of many lengths in one batch (`text-lengths`)",
        "",
        f"`bench/text_lengths.py` on {time.strftime('%Y-%m-%d')}: ONNX Runtime on 2 threads, {len(texts)} texts of "
        f"{min(lengths)} to {max(lengths)} tokens (median {int(np.median(lengths))}, mean {np.mean(lengths):.1f}), "
        f"{args.secs:g} s per point. Each batch's rows are grouped as the tokenize step groups them: each group as "
        "long as padding its rows to its longest adds at most `waste` of their own tokens; `inf` is the whole batch "
        "padded to its longest.",
    ]
    for title, path in MODELS.items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}

        def rate(batch, waste):
            """Rows/s and rows per call, over `args.secs`."""
            rows = calls = 0
            start, i = time.perf_counter(), 0
            while time.perf_counter() - start < args.secs:
                enc = tok.encode_batch([texts[(i + k) % len(texts)] for k in range(batch)])
                i += batch
                for group in groups([len(e.ids) for e in enc], waste):
                    session.run(None, feed(enc, group, names))
                    rows += len(group)
                    calls += 1
            return rows / (time.perf_counter() - start), rows / calls

        alone = rate(1, 0.0)[0]
        lines += ["", f"## {title}", "", f"One text at a time: {alone:.1f} rows/s.", "",
                  "| rows per batch | waste | rows/s | / one at a time | rows per call |", "|---:|---:|---:|---:|---:|"]
        for batch in (8, 32):
            for waste in WASTES:
                r, per = rate(batch, waste)
                lines.append(f"| {batch} | {waste:g} | {r:.1f} | {r / alone:.2f} | {per:.1f} |")
                print(title, lines[-1], flush=True)
    out = RESULTS / "text-lengths.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
