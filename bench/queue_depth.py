"""What forming a batch costs under a model's queue lock when the queue is deep (bench/run.sh
--queue-depth [--rev REV]): the `queue_depth` example of ferrite-core (a queue kept 1,024 requests
deep, batches of 2, 16 and 64 rows taken from it, requests of no share or of 2, 8 or 512 tenants'
shares), built from this tree and, with `--rev`, from that commit with this tree's example copied
in; each binary runs pinned to core 0, by turns, `--rounds` times. Writes
bench/results/queue-depth.md.

Usage: python3 bench/queue_depth.py [--rev REV] [--rounds 2]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.run import RESULTS, ROOT, WORK  # noqa: E402

EXAMPLE = Path("crates/ferrite-core/examples/queue_depth.rs")


def build(tree, name, target):
    """The example built from `tree` in `target` (a tree of its own: a build script's output holds its
    tree's path), copied to WORK/name."""
    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "ferrite-core", "--example", "queue_depth"],
                   cwd=tree, check=True, env=dict(os.environ, CARGO_TARGET_DIR=str(target)))
    out = WORK / name
    shutil.copy(target / "release" / "examples" / "queue_depth", out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", help="a commit to measure beside this tree")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    binaries = {}
    if args.rev:
        rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.strip()
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            subprocess.run(["git", "worktree", "add", "--quiet", "--detach", str(tree), rev], cwd=ROOT, check=True)
            try:
                shutil.copy(ROOT / EXAMPLE, tree / EXAMPLE)
                binaries[rev] = build(tree, "queue_depth-rev", ROOT / "target" / "queue-depth-rev")
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
    binaries["this tree"] = build(ROOT, "queue_depth-tree", ROOT / "target")
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    lines = [
        "# What forming a batch costs when a model's queue is deep (`queue-depth`)",
        "",
        f"`bench/queue_depth.py` on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, pinned to core 0: the "
        "`queue_depth` example of ferrite-core (a queue kept 1,024 one-row requests deep, its default "
        "`max_queue_size`; each cell: microseconds a batch, for deciding it, taking it and queueing as many "
        "new requests, the median of three runs), the binaries by turns.",
    ]
    for r in range(args.rounds):
        for label, binary in binaries.items():
            out = subprocess.run([*pin, str(binary)], check=True, capture_output=True, text=True).stdout
            lines += ["", f"## Round {r + 1}: {label}", "", out.strip()]
            print(f"round {r + 1}, {label}:\n{out}", flush=True)
    (RESULTS / "queue-depth.md").write_text("\n".join(lines) + "\n")
    print("wrote bench/results/queue-depth.md")


if __name__ == "__main__":
    main()
