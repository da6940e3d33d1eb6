#!/usr/bin/env bash
# Load benchmark: Ferrite vs a FastAPI + onnxruntime baseline vs the engine alone, on one machine,
# in one run. Writes bench/results/<name>.md. Guards the issue-2 bar: Ferrite >= 10x the baseline's
# throughput with <= 1/5 of its p99 at 128 concurrent batch-1 clients.
#
# Usage: bench/run.sh [--duration 20] [--clients 128] [--name mlp] [--variants]
#        bench/run.sh --cache [--duration 20]   (the response-cache benchmark: bench/cache.py)
#        bench/run.sh --fleet [--duration 20]   (1-3 replicas behind HAProxy on a Redis Cluster: bench/fleet.py)
#        bench/run.sh --kinds [--duration 10] [--pin]  (model kinds against their ceilings: bench/kinds.py;
#                                              --pin: server and ceiling on core 0, load generators on core 1)
#        bench/run.sh --pipelines [--duration 10]  (image and text pipelines vs FastAPI and the ceiling)
#        bench/run.sh --texts [--duration 10]  (TEI's /rerank and /predict vs FastAPI and the ceiling: bench/texts.py)
#        bench/run.sh --text-lengths [--secs 3]  (texts of many lengths in one batch, in-process: what
#                                              padding costs and grouping gives back: bench/text_lengths.py)
#        bench/run.sh --text-latency [--rounds 4]  (one client's text embeddings against the engine in-process,
#                                              side by side round by round: bench/text_latency.py)
#        bench/run.sh --queue-depth [--rev REV]  (what forming a batch costs when a model's queue is deep,
#                                              of this tree and of commit REV: bench/queue_depth.py)
#        bench/run.sh --profile [--model tiny]  (where the server's time goes per front-end: bench/profile.py)
#        bench/run.sh --soak [--minutes 5]      (memory over a long run: bench/soak.py)
#        bench/run.sh --memory [--duration 5]   (memory per model kind, weights shared or not: bench/memory.py)
#        bench/run.sh --bursts [A B]            (memory a burst leaves behind, per binary given: bench/bursts.py)
#        bench/run.sh --ab A B [--models tiny,mlp] (two server binaries alternated, pinned: bench/ab.py)
#        bench/run.sh --together A B [--clients 1] (two binaries served at once, one load alternating
#                                              between them in short windows: bench/together.py)
#        bench/run.sh --instructions A [B] [--models tiny,mlp] (the server's own instructions per request
#                                              under callgrind, one client: bench/instructions.py)
#        bench/run.sh --hostile [--duration 10] (a steady client beside floods: bench/hostile.py)
#        bench/run.sh --bad-rows A B [--rounds 2] (pipeline requests beside failing rows and answers of
#                                              other sizes, two binaries alternated: bench/bad_rows.py)
#        bench/run.sh --python-models [--duration 5] (a model.py's cost per request: bench/python_models.py)
#        bench/run.sh --shared-memory [--models detector320,resnet,mlp] (tensors through Triton's system
#                                              shared memory against the request, pinned: bench/shared_memory.py)
#        bench/run.sh --all                     (kinds, profile and soak in one go, about 20 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."

OHA_VERSION=1.16.0
if ! command -v oha >/dev/null || [ "$(oha --version | awk '{print $2}')" != "$OHA_VERSION" ]; then
    cargo install oha --version "$OHA_VERSION" --locked
fi
if ! python3 -c "import fastapi, uvicorn, httptools, uvloop, onnxruntime, numpy, onnx, PIL, tokenizers" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check -r bench/requirements.txt
fi
# Triton's perf_analyzer, the reference gRPC load generator: tritonclient 2.51.0 ships it (newer
# wheels need a newer glibc); it wants libb64 and a libcudart (from the CUDA runtime wheel).
PA=bench/.work/pa
if [ ! -x "$PA/tritonclient-2.51.0.data/data/bin/perf_analyzer" ]; then
    mkdir -p "$PA"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$PA" \
        tritonclient==2.51.0 nvidia-cuda-runtime-cu12==12.9.79
    python3 - "$PA" <<'PY'
import glob, sys, zipfile
pa = sys.argv[1]
zipfile.ZipFile(glob.glob(f"{pa}/tritonclient-2.51.0-*.whl")[0]).extract("tritonclient-2.51.0.data/data/bin/perf_analyzer", pa)
zipfile.ZipFile(glob.glob(f"{pa}/nvidia_cuda_runtime_cu12-*.whl")[0]).extract("nvidia/cuda_runtime/lib/libcudart.so.12", pa)
PY
    chmod +x "$PA/tritonclient-2.51.0.data/data/bin/perf_analyzer"
fi
if ! ldconfig -p | grep -q libb64.so.0d; then
    apt-get update -qq && apt-get install -y -qq libb64-0d
fi
cargo build --release --locked --bin ferrite --example ceiling
if [ "${1:-}" = "--cache" ]; then
    shift
    command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
    exec python3 bench/cache.py "$@"
fi
if [ "${1:-}" = "--fleet" ]; then
    shift
    export PATH="$PATH:/usr/sbin"
    command -v redis-server >/dev/null && command -v haproxy >/dev/null \
        || { apt-get update -qq && apt-get install -y -qq redis-server haproxy; }
    exec python3 bench/fleet.py "$@"
fi
if [ "${1:-}" = "--pipelines" ]; then
    shift
    exec python3 bench/pipelines.py "$@"
fi
if [ "${1:-}" = "--texts" ]; then
    shift
    exec python3 bench/texts.py "$@"
fi
if [ "${1:-}" = "--text-lengths" ]; then
    shift
    exec python3 bench/text_lengths.py "$@"
fi
if [ "${1:-}" = "--queue-depth" ]; then
    shift
    exec python3 bench/queue_depth.py "$@"
fi
if [ "${1:-}" = "--text-latency" ]; then
    shift
    exec python3 bench/text_latency.py "$@"
fi
if [ "${1:-}" = "--kinds" ]; then
    shift
    exec python3 bench/kinds.py "$@"
fi
if [ "${1:-}" = "--profile" ] || [ "${1:-}" = "--all" ] || [ "${1:-}" = "--ab" ]; then
    command -v perf >/dev/null || { apt-get update -qq && apt-get install -y -qq linux-perf; }
fi
if [ "${1:-}" = "--profile" ]; then
    shift
    exec python3 bench/profile.py "$@"
fi
if [ "${1:-}" = "--soak" ]; then
    shift
    exec python3 bench/soak.py "$@"
fi
if [ "${1:-}" = "--shared-memory" ]; then
    shift
    exec python3 bench/shared_memory.py "$@"
fi
if [ "${1:-}" = "--python-models" ]; then
    shift
    exec python3 bench/python_models.py "$@"
fi
if [ "${1:-}" = "--ab" ]; then
    shift
    exec python3 bench/ab.py "$@"
fi
if [ "${1:-}" = "--together" ]; then
    shift
    exec python3 bench/together.py "$@"
fi
if [ "${1:-}" = "--memory" ]; then
    shift
    exec python3 bench/memory.py "$@"
fi
if [ "${1:-}" = "--bursts" ]; then
    shift
    exec python3 bench/bursts.py "$@"
fi
if [ "${1:-}" = "--instructions" ]; then
    shift
    command -v callgrind_control >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
    exec python3 bench/instructions.py "$@"
fi
if [ "${1:-}" = "--hostile" ]; then
    shift
    exec python3 bench/hostile.py "$@"
fi
if [ "${1:-}" = "--bad-rows" ]; then
    shift
    exec python3 bench/bad_rows.py "$@"
fi
if [ "${1:-}" = "--all" ]; then
    # The whole suite in one go (about 20 minutes): model kinds, the per-front-end profile, and
    # memory over five minutes.
    shift
    python3 bench/kinds.py --duration 8 "$@"
    python3 bench/profile.py
    exec python3 bench/soak.py
fi
exec python3 bench/run.py "$@"
