#!/usr/bin/env bash
# Create .venv (once) and install dcp_opt with the given extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev,runtime}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')-$(sha256sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".[${extras}]"
  touch "$stamp"
fi
