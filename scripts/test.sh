#!/usr/bin/env bash
# Set up and run the whole test suite (lint, format, pytest). Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,runtime,hf,megatron,video
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
