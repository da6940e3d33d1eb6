#!/usr/bin/env bash
# Load benchmark: Ferrite vs a FastAPI + onnxruntime baseline vs the engine alone, on one machine,
# in one run. Writes bench/results/<name>.md. Guards the issue-2 bar: Ferrite >= 10x the baseline's
# throughput with <= 1/5 of its p99 at 128 concurrent batch-1 clients.
#
# Usage: bench/run.sh [--duration 20] [--clients 128] [--name mlp] [--variants]
set -euo pipefail
cd "$(dirname "$0")/.."

OHA_VERSION=1.16.0
if ! command -v oha >/dev/null || [ "$(oha --version | awk '{print $2}')" != "$OHA_VERSION" ]; then
    cargo install oha --version "$OHA_VERSION" --locked
fi
if ! python3 -c "import fastapi, uvicorn, onnxruntime, numpy" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check -r bench/requirements.txt
fi
cargo build --release --locked --bin ferrite --example ceiling
exec python3 bench/run.py "$@"
