#!/usr/bin/env bash
# CI (issue 28): dcp_opt as a user gets it. The checkout's tracked files are built into a wheel
# (once), the wheel is installed NOT editable with its declared dependencies (extras
# ${DCP_CI_EXTRAS:-runtime}) into a fresh venv, and scripts/installed_smoke.py runs, from a
# folder outside the repository, every `dcp-opt` verb once and README's Python snippets.
# An editable install (what the tests use) hides missing packages, package data and imports.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/dcp_installed.XXXXXX")"
trap '(rm -rf "$work" > /dev/null 2>&1 &)' EXIT  # a venv with torch takes a minute to delete: not waited for
started=$SECONDS

# the tracked files as they are (a clean clone in CI); no build/ or egg-info in the checkout
mkdir -p "$work/src"
if git -C "$repo" rev-parse --git-dir > /dev/null 2>&1; then
  (cd "$repo" && git ls-files -z | xargs -0 cp --parents -t "$work/src")
else
  cp -r "$repo"/. "$work/src"
fi
builder="$repo/.venv/bin/python"  # has setuptools (scripts/setup.sh); any python3 with it will do
[ -x "$builder" ] || builder=python3
"$builder" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
wheel="$(ls "$work"/dist/dcp_opt-*.whl)"

python3 -m venv "$work/venv"
# --no-compile: byte-compiling torch's files at install took longer than running every verb
"$work/venv/bin/pip" install -q --no-compile --disable-pip-version-check "${wheel}[${DCP_CI_EXTRAS:-runtime}]" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "installed $(basename "$wheel") into a fresh venv ($((SECONDS - started)) s)"

cd "$work"  # outside the repository: nothing of the checkout on sys.path
"$work/venv/bin/python" "$repo/scripts/installed_smoke.py" --repo "$repo"
echo "installed-package check: $((SECONDS - started)) s"
