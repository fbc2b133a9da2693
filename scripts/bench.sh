#!/usr/bin/env bash
# Set up and run the main job: the simulated side-by-side benchmark of every planner.
#   1. over a stream (one epoch per workload): each published method as its users run it,
#      the project's planners at matched tokens per optimizer step (out/stream.json);
#   2. one batch at a time: the published profile forced into the same fixed batches
#      (out/bench.json).
# Arguments go to the stream benchmark (e.g. --quick: a smaller epoch, under 2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
mkdir -p out
.venv/bin/dcp-opt bench --stream --json out/stream.json "$@"
.venv/bin/dcp-opt bench --json out/bench.json
