"""Every notebook in notebooks/ runs headless at small size (DCP_OPT_NB_SMALL=1), as in CI.

The jupytext percent-format .py files are the source of truth (notebooks/README.md): each is
converted with jupytext and executed with nbclient on a kernel of this very interpreter (a
kernel spec written to a temporary JUPYTER_PATH, so a `python3` kernel installed elsewhere
cannot be picked up). A cell that raises fails the test. Figures saved under DCP_OPT_NB_OUT
must be PNGs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jupytext  # the dev extra: pip install -e .[dev]
import nbclient
import pytest

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.py"))
KERNEL = "dcp-opt-test"
PNG = b"\x89PNG\r\n\x1a\n"
# figures each notebook saves when DCP_OPT_NB_OUT is set (prefix -> at least how many)
EXPECTED_PNGS = {"01": ("anatomy_", 3), "02": ("", 0), "03": ("whatif", 1)}


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("DCP_OPT_NB_SMALL", "1")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("DCP_OPT_NB_OUT", str(out))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return out


def test_the_three_notebooks_are_here():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_headless(path, kernel_env, tmp_path):
    nb = jupytext.read(path)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name=KERNEL, resources={"metadata": {"path": str(tmp_path)}}
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the failing cell
    wall = time.perf_counter() - started
    assert wall < 120, f"{path.name} took {wall:.0f} s in small mode"
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    prefix, count = EXPECTED_PNGS[path.name[:2]]
    pngs = sorted(kernel_env.glob(f"{prefix}*.png")) if count else []
    assert len(pngs) >= count
    assert all(p.read_bytes()[:8] == PNG for p in pngs)
    # every figure shown inline is a PNG, not a text repr of a Figure object
    shown = [o["data"] for o in outputs if "data" in o]
    assert not [d for d in shown if "text/plain" in d and "<Figure" in d["text/plain"]
                and "image/png" not in d]  # fmt: skip
