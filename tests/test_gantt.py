"""The plan picture: what is drawn where (hand arithmetic), the CLI, and lazy matplotlib."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from matplotlib.collections import PatchCollection
from matplotlib.colors import to_rgba

from dcp_opt import Batch, Group, MicroBatch, make_plan
from dcp_opt.analysis.gantt import COLORS, plot_plan
from dcp_opt.cli import main
from tests.toy import toy_cost


def _boxes(ax, color: str) -> list[tuple[float, float, float, float]]:
    """(x, y, width, height) of every rectangle drawn in `color` on `ax`."""
    out = []
    for coll in ax.collections:
        if not isinstance(coll, PatchCollection) or not len(coll.get_facecolor()):
            continue
        faces = coll.get_facecolor()
        for k, path in enumerate(coll.get_paths()):
            if np.allclose(faces[k % len(faces)], to_rgba(color)):
                (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
                out.append(tuple(round(float(v), 9) for v in (x0, y0, x1 - x0, y1 - y0)))
    return sorted(out)


def test_boxes_follow_the_simulated_timeline():
    cm = toy_cost()
    batch = Batch.from_lengths([8, 2, 2])
    # As tests/test_core.py::test_simulate_tiny_plan: group A (ranks 0-1) runs seq 0 with
    # r=1: compute 6*8/2 + 0.5 = 24.5 s then recompute 8/2 = 4 s. Group B (rank 2) runs seqs 1
    # and 2: 6*2 + 0.5 = 12.5 s each. Rank 3 idles. The toy has no communication and no
    # gradient sync, so the step is 28.5 s.
    plan = make_plan(
        [[Group(0, 2, (MicroBatch((0,), 1),)), Group(2, 1, (MicroBatch((1,)), MicroBatch((2,))))]],
        batch,
        cm,
        planner="hand",
    )
    fig = plot_plan(plan, batch, cm)
    ax = fig.axes[0]
    assert _boxes(ax, COLORS["compute"]) == [
        (0.0, 0.0, 24.5, 2.0),
        (0.0, 2.0, 12.5, 1.0),
        (12.5, 2.0, 12.5, 1.0),
    ]
    assert _boxes(ax, COLORS["recompute"]) == [(24.5, 0.0, 4.0, 2.0)]
    assert _boxes(ax, COLORS["comm"]) == []
    # idle background over all 4 ranks up to the finish
    assert _boxes(ax, COLORS["idle"]) == [(0.0, 0.0, 28.5, 4.0)]
    # memory side bar: model states 9 B on every rank; activations to the peak: rank 0-1 97 B
    # (9 + 4*(30-8)), rank 2: 9 + 2*30 = 69 B, rank 3 none. Bars are in GB.
    mem = fig.axes[1]
    widths = sorted(p.get_width() * 1e9 for p in mem.patches)
    assert widths == pytest.approx(sorted([9.0] * 4 + [88.0, 88.0, 60.0, 0.0]))
    assert "step 28.500 s" in fig._suptitle.get_text()


def test_show_cli_writes_a_png(tmp_path, capsys):
    lengths = tmp_path / "b.txt"
    lengths.write_text("600000\n2048\n512\n")
    plan, png = tmp_path / "plan.json", tmp_path / "plan.png"
    common = ["--lengths", str(lengths), "--cluster", "h200x8"]
    assert main(["plan", *common, "--planner", "static_tuned", "--out", str(plan)]) == 0
    assert main(["show", str(plan), *common, "--out", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    capsys.readouterr()
    assert main(["show", str(plan), *common, "--out", str(tmp_path / "x.nope")]) == 2
    assert "out" in capsys.readouterr().err
    # a plan for other inputs is refused, with every violation
    lengths.write_text("600000\n2048\n")
    assert main(["show", str(plan), *common, "--out", str(png)]) == 1
    assert "UNKNOWN_SEQUENCE" in capsys.readouterr().err


def test_matplotlib_is_imported_lazily():
    code = (
        "import sys, dcp_opt, dcp_opt.cli, dcp_opt.analysis.gantt, dcp_opt.analysis.bench, dcp_opt.analysis.bench_display; "
        "print('matplotlib' in sys.modules, 'rich' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
