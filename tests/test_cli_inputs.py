"""Issue 29, "Inputs are exact or refused": integers are integers, figures the cost model
divides by stay in range, sizes are capped, files that are not UTF-8 say so, options out of
range are refused at once, and `show --out` writes where it says. Each case once in the
library, and once through the command line (exit 2, one line)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dcp_opt import Batch, Cluster, DcpOptError, ModelSpec, Plan, PlanFormatError, Sequence
from dcp_opt.cli import main

GOOD_CLUSTER = {"num_nodes": 1, "gpus_per_node": 8, "memory_bytes": 80e9, "peak_flops": 312e12,
                "intra_node_bw": 300e9, "inter_node_bw": 25e9}  # fmt: skip
MODEL = {"name": "m", "kind": "1d", "num_layers": 2, "hidden": 64, "num_heads": 4,
         "ffn_hidden": 128}  # fmt: skip


def _file(tmp_path: Path, name: str, text: str | bytes) -> str:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-opt: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---- integers are integers --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ([[1.9, 2, 3]], "entries must all be integers"),
        ([[True, 2, 3]], "entries must all be integers"),  # was the shape (1, 2, 3)
        ([True, 5], "entries must all be integers"),
        ({"sequences": [{"id": 0.7, "shape": [5]}]}, r"sequences\[0\].id: must be an integer"),
        ({"sequences": [{"id": True, "shape": [5]}]}, r"sequences\[0\].id: must be an integer"),
        ({"sequences": [{"id": 0, "shape": [5.0]}]}, r"sequences\[0\].shape: must be a list of"),
        ({"sequences": [{"id": 0, "shape": [False]}]}, r"sequences\[0\].shape: must be a list"),
    ],
)
def test_json_batches_take_exact_integers(tmp_path, capsys, doc, match):
    p = _file(tmp_path, "b.json", json.dumps(doc))
    rc = main(["plan", "--lengths", p, "--cluster", "h200x8", "--model", "opensora-stdit3-xl"])
    assert rc == 2
    line = _one_error(capsys)
    import re

    assert re.search(match, line), line


def test_sequences_and_shapes_refuse_bools_and_floats():
    with pytest.raises(DcpOptError, match="sequence.id: must be an integer"):
        Sequence(True, (5,))
    with pytest.raises(DcpOptError, match="every entry must be an integer"):
        Sequence(0, (True,))
    with pytest.raises(DcpOptError, match=r"shape\[0\]: must be 3 integers"):
        Batch.from_shapes([(1.9, 2, 3)])  # int() made it 1 before
    with pytest.raises(DcpOptError, match=r"length\[0\]"):
        Batch.from_lengths([True])


@pytest.mark.parametrize("field", ["dtype_bytes", "num_layers", "hidden", "vocab_size"])
@pytest.mark.parametrize("value", [True, 2.0, 10**400])
def test_model_files_take_exact_integers(tmp_path, capsys, field, value):
    model = _file(tmp_path, "m.json", json.dumps({**MODEL, "dtype_bytes": 2, field: value}))
    lengths = _file(tmp_path, "l.txt", "128\n")
    assert main(["plan", "--lengths", lengths, "--cluster", "h200x8", "--model", model]) == 2
    line = _one_error(capsys)
    assert f"model.{field}: must be an integer" in line
    assert len(line) < 300  # a 400-digit number is shown short


# ---- figures the cost model divides by --------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("intra_node_latency_s", 1e308),  # NaN step times, exit 0, before
        ("intra_node_bw", 1e-300),  # greedy looped for ever, before
        ("peak_flops", 1e-300),  # IndexError in greedy, before
        ("speed_factors", [1e-300] * 8),  # ZeroDivisionError in greedy, before
        ("memory_bytes", 10**400),
        ("num_nodes", True),
    ],
)
def test_cluster_files_keep_every_figure_in_range(tmp_path, capsys, field, value):
    cluster = _file(tmp_path, "c.json", json.dumps({**GOOD_CLUSTER, field: value}))
    lengths = _file(tmp_path, "l.txt", "4096\n65536\n128\n")
    rc = main(["plan", "--lengths", lengths, "--cluster", cluster, "--model", "llama-1b"])
    assert rc == 2
    assert f"cluster.{field}" in _one_error(capsys)


def test_the_toy_units_of_the_tests_stay_allowed():
    Cluster("toy", 1, 4, 100.0, 1.0, 0.25, 0.5, speed_factors=(0.4, 1.0, 1.3, 100.0))


# ---- caps ---------------------------------------------------------------------------------------
@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "preset",
    # the 400-digit name: an OSError (file name too long) from Path.exists() before
    ["h200x1000000000", "gb200-nvl72x100000", "h200x" + "8" * 30, "gb200-nvl72x" + "1" * 400],
)
def test_huge_presets_are_refused_at_once(capsys, preset):
    started = time.perf_counter()
    assert main(["plan", "--workload", "1d-short", "--cluster", preset]) == 2
    assert time.perf_counter() - started < 5  # gb200-nvl72x100000 took 8 GB and minutes
    assert "at most 65536" in _one_error(capsys)
    with pytest.raises(DcpOptError, match="at most 65536"):
        Cluster("big", 2**40, 8, 80e9, 1e15, 1e11, 1e10)


@pytest.mark.timeout(20)
def test_tokens_per_gpu_is_capped(capsys):
    from dcp_opt import standard_batch

    with pytest.raises(DcpOptError, match=r"tokens_per_gpu: must be an integer in \[1, 16777216\]"):
        standard_batch("1d-short", 0, tokens_per_gpu=10_000_000_000_000)  # never ended before
    argv = ["plan", "--workload", "1d-short", "--tokens-per-gpu", "10000000000000"]
    assert main(argv) == 2
    assert "argument --tokens-per-gpu: must be an integer, at most 16777216" in _one_error(capsys)


def test_sequences_per_batch_are_capped_with_how_to_split():
    one = {"id": 0, "shape": [5]}
    with pytest.raises(DcpOptError, match=r"1,048,577 sequences; at most 1,048,576 .* split it"):
        Batch.from_dict({"sequences": [one] * (2**20 + 1)})


def test_violation_lines_are_capped_with_a_count(tmp_path, capsys):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    plan = tmp_path / "p.json"
    inputs = ["--lengths", lengths, "--cluster", "h200x8", "--model", "llama-1b"]
    assert main(["plan", *inputs, "--out", str(plan)]) == 0
    doc = json.loads(plan.read_text())
    idle = {"start_rank": 0, "degree": 1, "kind": "ulysses", "micro_batches": []}
    doc["phases"].append({"groups": [idle] * 5000})  # 4,999 overlaps, 1 uncovered rank span
    plan.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["simulate", str(plan), *inputs]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) < 30, len(err)
    assert err[0].startswith("dcp-opt: invalid plan: 5000 violation(s)")
    assert any("... and 4,980 more (RANK_OVERLAP x" in x for x in err), err[-3:]


# ---- files that are not UTF-8, numbers past float range -----------------------------------------
@pytest.mark.parametrize(
    ("encode", "match"),
    [
        (lambda t: t.encode("utf-16"), "UTF-16 text; save it as UTF-8"),
        (lambda t: t.encode("utf-32"), "UTF-32 text; save it as UTF-8"),
        (lambda t: t.replace('"planner"', '"pl\xe9nner"').encode("latin-1"), "not UTF-8 text"),
    ],
)
def test_plan_files_in_other_encodings_are_clear_errors(tmp_path, capsys, encode, match):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    plan = tmp_path / "p.json"
    inputs = ["--lengths", lengths, "--cluster", "h200x8", "--model", "llama-1b"]
    assert main(["plan", *inputs, "--out", str(plan)]) == 0
    bad = _file(tmp_path, "bad.json", encode(plan.read_text()))
    capsys.readouterr()
    assert main(["simulate", bad, *inputs]) == 2  # a UnicodeDecodeError traceback before
    assert match in _one_error(capsys)
    # a UTF-8 byte-order mark is only a mark
    _file(tmp_path, "bom.json", b"\xef\xbb\xbf" + plan.read_bytes())
    assert main(["simulate", str(tmp_path / "bom.json"), *inputs]) == 0


def test_numbers_past_float_range_are_refused():
    from tests.fuzzing import plan_fixture

    d = plan_fixture()[0].to_dict()
    for key in ("loss_normalizer", "predicted_step_time_s"):
        doc = json.dumps({**d, key: 123456.5}).replace("123456.5", "9" * 400)
        with pytest.raises(PlanFormatError, match=f"plan.{key}: .*\\(400 characters\\)"):
            Plan.from_json(doc)  # OverflowError from float() before


def test_a_profile_number_past_float_range_is_refused(tmp_path):
    from dcp_opt.profile_io import ProfileError, load_profile
    from tests.fuzzing import profile_base

    doc = json.loads(json.dumps(profile_base()))  # a copy: profile_base() is cached
    doc["coefficients"]["microbatch_overhead_s"] = 123456.5
    p = _file(tmp_path, "p.json", json.dumps(doc).replace("123456.5", "9" * 400))
    with pytest.raises(ProfileError, match="microbatch_overhead_s: must be a finite number"):
        load_profile(p)  # OverflowError from math.isfinite before


def test_a_profile_of_zeros_is_refused(tmp_path):
    from dcp_opt.profile_io import ProfileError, load_profile
    from tests.fuzzing import profile_base

    doc = json.loads(json.dumps(profile_base()))  # a copy: profile_base() is cached
    for block in doc["coefficients"]["blocks"].values():
        for part in block.values():
            part.update(dict.fromkeys(part, 0.0))
    p = _file(tmp_path, "p.json", json.dumps(doc))
    with pytest.raises(ProfileError, match="every time coefficient is 0"):
        load_profile(p)


def test_long_digit_runs_are_shortened_in_the_error_line(capsys, tmp_path):
    p = _file(tmp_path, "l.txt", "1" + "0" * 400 + "\n")
    assert main(["plan", "--lengths", p, "--cluster", "h200x8", "--model", "llama-1b"]) == 2
    line = _one_error(capsys)
    assert len(line) < 300 and "sequence 0.shape" in line


# ---- options out of range, `show --out` -------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--dpi", "100000"], "argument --dpi: must be an integer in [10, 600]"),
        (["--dpi", "0"], "argument --dpi"),
    ],
)
def test_show_refuses_a_huge_dpi(tmp_path, capsys, argv, named):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    inputs = ["--lengths", lengths, "--cluster", "h200x8", "--model", "llama-1b"]
    plan = str(tmp_path / "p.json")
    assert main(["plan", *inputs, "--out", plan]) == 0
    capsys.readouterr()
    assert main(["show", plan, *inputs, "--out", str(tmp_path / "x.png"), *argv]) == 2
    assert named in _one_error(capsys)


def test_show_writes_where_it_says(tmp_path, capsys):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    inputs = ["--lengths", lengths, "--cluster", "h200x8", "--model", "llama-1b"]
    plan = str(tmp_path / "p.json")
    assert main(["plan", *inputs, "--out", plan]) == 0
    capsys.readouterr()
    assert main(["show", plan, *inputs, "--out", str(tmp_path / "name")]) == 2
    assert "out: " in _one_error(capsys) and not list(tmp_path.glob("name*"))  # name.png before
    assert main(["show", plan, *inputs, "--out", str(tmp_path / "chart.SVG")]) == 0
    assert (tmp_path / "chart.SVG").read_text().lstrip().startswith("<?xml")


def test_a_seed_past_32_bits_is_refused(tmp_path, capsys):
    # OR-Tools raised a TypeError inside cpsat, which fell back to greedy and exited 0
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    argv = ["plan", "--lengths", lengths, "--cluster", "h200x8", "--model", "llama-1b",
            "--planner", "cpsat", "--seed", str(2**64)]  # fmt: skip
    assert main(argv) == 2
    assert "seed: must be at most 2147483647" in _one_error(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--batches", "1000000000"],
        ["bench", "--stream", "--epoch-batches", "100000"],
        ["bench", "--stream", "--step-sizes", "inf"],
        ["bench", "--stream", "--former-k", "1000000"],
        ["whatif", "--lengths", "L", "--gpus", "8,100000000"],
        ["whatif", "--lengths", "L", "--sweep-batches", "99999999"],
        ["plan", "--workload", "1d-short", "--workers", "100000"],
        ["whatif", "--lengths", "L", "--seed", str(2**64)],  # cpsat failed on every batch, exit 0
        ["bench", "--seed", str(2**31 - 1), "--batches", "2"],
    ],
)
def test_huge_option_values_are_refused_at_once(tmp_path, capsys, argv):
    lengths = _file(tmp_path, "l.txt", "4096\n128\n")
    started = time.perf_counter()
    assert main([lengths if a == "L" else a for a in argv]) == 2
    assert time.perf_counter() - started < 5
    _one_error(capsys)


def test_model_spec_fields_refuse_bools():
    with pytest.raises(DcpOptError, match="model.dtype_bytes"):
        ModelSpec.from_dict({**MODEL, "dtype_bytes": True})
    with pytest.raises(DcpOptError, match="model.num_params"):
        ModelSpec.from_dict({**MODEL, "num_params": 10**400})


@pytest.mark.parametrize("key", ["quad", "lin"])
def test_a_profile_coefficient_of_1e308_is_refused(tmp_path, key):
    # found by the extreme-input fuzzer: step times overflowed, and greedy raised IndexError
    # (lin) or ran for ever (microbatch_overhead_s)
    from dcp_opt.profile_io import ProfileError, load_profile
    from tests.fuzzing import profile_base

    doc = json.loads(json.dumps(profile_base()))  # a copy: profile_base() is cached
    doc["coefficients"]["blocks"]["layer"]["fwd"][key] = 1e308
    p = _file(tmp_path, "p.json", json.dumps(doc))
    with pytest.raises(ProfileError, match=f"fwd.{key}: must be a finite number >= 0 .at most 1e"):
        load_profile(p)
