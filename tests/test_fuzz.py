"""Fuzzing every public input: plan JSON, lengths files, profile JSON, CLI arguments.

Each case must be accepted, or rejected with a DcpOptError (the CLI: exit 2 and one
`dcp-opt: error:` line); never an unhandled exception (tests/fuzzing.py has the cases).
The hand-built tests below pin the crashes the fuzzers found, one per fix.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings

from dcp_opt import DcpOptError, ModelSpec, Plan, PlanFormatError, Sequence, validate
from dcp_opt.cli import main
from dcp_opt.workloads import load_batch, standard_batch
from tests.counts import EXAMPLES
from tests.fuzz_extreme import KINDS, run_extreme_case
from tests.fuzzing import ALL_TARGETS, TARGETS, attempt, plan_fixture, profile_base


def test_every_public_input_is_fuzzed():
    assert (
        set(TARGETS)
        == set(ALL_TARGETS)
        == {
            "plan_json",
            "lengths_file",
            "profile_json",
            "cli_args",
            "extreme_inputs",
        }
    )


@pytest.mark.parametrize("name", list(TARGETS))
def test_fuzz_never_raises_an_unhandled_exception(name):
    strategy, run = TARGETS[name]

    @given(strategy())
    def prop(case):
        EXAMPLES[f"fuzz[{name}]"] += 1
        out = attempt(run, case)
        assert out.kind != "unhandled", (case, out.detail)
        if out.kind == "rejected":  # the message names the problem: never empty
            assert out.detail.strip(), case

    prop()


@pytest.mark.parametrize("kind", KINDS)
def test_every_extreme_kind_is_handled(kind):
    """Issue 29's kinds, each on its own (the mixed strategy above may draw few of one):
    never a traceback, exit 3, a hang, a runaway, or a case that must be refused accepted."""
    import tests.fuzz_extreme as fx

    strategy = getattr(fx, kind)

    @settings(max_examples=12)
    @given(strategy())
    def prop(case):
        EXAMPLES[f"fuzz[extreme:{kind}]"] += 1
        assert case.kind == kind
        out = attempt(run_extreme_case, case)
        assert out.kind != "unhandled", (case, out.detail)

    prop()


def test_valid_inputs_are_accepted():
    # the fuzzers' base cases must pass, or every mutation would be rejected for nothing
    plan, _, _ = plan_fixture()
    assert attempt(TARGETS["plan_json"][1], plan.to_json()).kind == "accepted"
    assert attempt(TARGETS["lengths_file"][1], (".txt", b"128\n4096\n")).kind == "accepted"
    good_profile = json.dumps(profile_base())
    assert attempt(TARGETS["profile_json"][1], good_profile).kind == "accepted"


# ---- one regression per crash the fuzzers found ------------------------------------------
def test_recursion_bombs_are_clear_errors(tmp_path):
    bomb = "[" * 100_000 + "]" * 100_000
    with pytest.raises(PlanFormatError, match="nested too deeply"):
        Plan.from_json(bomb)
    p = tmp_path / "b.json"
    p.write_text(bomb)
    with pytest.raises(DcpOptError, match="b.json: not valid JSON .nested too deeply"):
        load_batch(p)
    from dcp_opt.profile_io import load_profile

    with pytest.raises(DcpOptError, match="nested too deeply"):
        load_profile(p)


def test_integers_past_the_digit_limit_are_clear_errors(tmp_path):
    p = tmp_path / "b.json"
    p.write_text("[" + "9" * 5000 + "]")
    with pytest.raises(DcpOptError, match="b.json: not valid JSON"):
        load_batch(p)
    with pytest.raises(PlanFormatError, match="plan: not valid JSON"):
        Plan.from_json('{"schema_version": ' + "9" * 5000 + "}")


def test_non_utf8_lengths_file_names_the_byte(tmp_path):
    p = tmp_path / "l.txt"
    p.write_bytes(b"12\n\xb3\xd8\n")
    with pytest.raises(DcpOptError, match=r"not UTF-8 text \(byte 3\)"):
        load_batch(p)


def test_huge_lengths_are_rejected_before_costing(tmp_path):
    # 10**200 tokens would overflow float64 when squared (attention work); 2**53 is the cap
    with pytest.raises(DcpOptError, match=r"sequence 0.shape: .* more than .* \(2\*\*53\)"):
        Sequence(0, (10**200,))
    Sequence(0, (2**53,))  # the cap itself is fine
    with pytest.raises(DcpOptError, match=r"sequence 1.shape"):
        Sequence(1, (2**20, 2**20, 2**14))  # 2**54 tokens in three factors
    p = tmp_path / "l.txt"
    p.write_text("1" + "0" * 300 + "\n")
    with pytest.raises(DcpOptError, match="sequence 0.shape"):
        load_batch(p)


def test_negative_seed_is_a_clear_error():
    with pytest.raises(DcpOptError, match="seed: must be an integer >= 0, got -5"):
        standard_batch("1d-short", -5)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--workload", "1d-short"],
        # found by the nightly CLI fuzz run: numpy's generator raised ValueError
        ["whatif", "--lengths", "LENGTHS", "--batches", "1", "--planners", "bucket"],
    ],
)
def test_cli_negative_seed_exits_2_with_one_line(capsys, tmp_path, argv):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("128\n4096\n")
    argv = [str(lengths) if a == "LENGTHS" else a for a in argv]
    rc = main([*argv, "--seed", "-5", "--cluster", "h200x8"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == "dcp-opt: error: seed: must be an integer >= 0, got -5"


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-1", "0"])
def test_non_finite_or_non_positive_normaliser_is_rejected(text):
    plan, batch, cost = plan_fixture()
    d = plan.to_dict()
    d["loss_normalizer"] = 12345.5
    doc = json.dumps(d).replace("12345.5", text)
    with pytest.raises(PlanFormatError, match="plan.loss_normalizer: must be a finite number"):
        Plan.from_json(doc)


def test_validate_flags_a_nan_normaliser_built_in_python():
    # NaN compares false with everything: "abs(x - want) > tol" let it through before
    plan, batch, cost = plan_fixture()
    from dataclasses import replace

    bad = replace(plan, loss_normalizer=math.nan)
    assert "BAD_NORMALIZER" in {v.code for v in validate(bad, batch, cost)}


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_params", [1, 2], "model.num_params: must be a finite number > 0 or null"),
        ("num_params", -1.0, "model.num_params"),
        ("vocab_size", "big", "model.vocab_size: must be an integer >= 0"),
        ("text_tokens", -3, "model.text_tokens"),
        ("gated_mlp", "yes", "model.gated_mlp: must be true or false"),
    ],
)
def test_model_spec_fields_are_checked(field, value, match):
    d = ModelSpec("m", "1d", 2, 64, 4, 128).to_dict()
    d[field] = value
    with pytest.raises(DcpOptError, match=match):
        ModelSpec.from_dict(d)
