#!/usr/bin/env bash
# Set up and run the main job: the simulated side-by-side benchmark of every planner.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
mkdir -p out
.venv/bin/dcp-opt bench --json out/bench.json "$@"
