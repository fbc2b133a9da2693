"""Fuzz report: run every public-input fuzzer for N cases and count what happened.

    .venv/bin/python benchmarks/fuzz_report.py --examples 2000 --json fuzz_report.json

For each input (plan JSON, lengths file, profile JSON, CLI arguments, extreme inputs through
the CLI) the JSON holds the cases tried, how many were accepted, rejected with a clear error, or
unhandled (mishandled: must be 0), the distinct unhandled errors with one example each, and the
wall time; for extreme inputs also the same counts per kind (`kinds`: extreme finite values,
other encodings, bools and floats as integers, huge GPU counts, huge option values, giant
plans; tests/fuzz_extreme.py says what counts as mishandled: a traceback, exit 3, a hang, a
runaway in memory or output, or a case that must be refused accepted). Exit status 1 if any
case was unhandled. The cases and the runner are tests/fuzzing.py (shared with
tests/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hyp_seed  # noqa: E402

from tests.fuzzing import ALL_TARGETS, KIND_OF, TARGETS, attempt  # noqa: E402

REPORT_SCHEMA = "dcp_opt.fuzz_report/2"  # 2: per-kind counts (`kinds`), `mishandled` totals


def fuzz_one(name: str, examples: int, seed: int) -> dict:
    strategy, run = TARGETS[name]
    counts: Counter[str] = Counter()
    unhandled: dict[str, dict] = {}
    rejections: Counter[str] = Counter()
    kind_of = KIND_OF.get(name)
    kinds: dict[str, Counter] = {}

    @hyp_seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # count fresh cases; shrinking would re-run known ones
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy())
    def body(case):
        out = attempt(run, case)
        counts[out.kind] += 1
        if kind_of is not None:
            kinds.setdefault(kind_of(case), Counter())[out.kind] += 1
        if out.kind == "unhandled":
            entry = unhandled.setdefault(
                out.detail[:160], {"count": 0, "example": repr(case)[:400]}
            )
            entry["count"] += 1
        elif out.kind == "rejected":
            rejections[_field(out.detail)] += 1

    started = time.perf_counter()
    body()
    per_kind = {
        k: {
            "cases": sum(c.values()),
            "accepted": c["accepted"],
            "rejected": c["rejected"],
            "mishandled": c["unhandled"],
        }
        for k, c in sorted(kinds.items())
    }
    return {
        "cases": sum(counts.values()),
        "accepted": counts["accepted"],
        "rejected": counts["rejected"],
        "unhandled": counts["unhandled"],
        "unhandled_errors": [{"error": k, **v} for k, v in unhandled.items()],
        "top_rejections": dict(rejections.most_common(12)),
        "wall_s": round(time.perf_counter() - started, 2),
        **({"kinds": per_kind} if kind_of is not None else {}),
    }


def _field(message: str) -> str:
    """The part of an error that names the field ("plan.phases[0].groups[1].degree: ...")."""
    message = message.removeprefix("dcp-opt: error: ")
    if "violation(s): " in message:  # an invalid plan: count its first violation code
        return "violation " + message.split("violation(s): ", 1)[1].split(":", 1)[0]
    head = message.split(":", 1)[0]
    return head[:60] if "." in head or "[" in head else message.split(" (", 1)[0][:40]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=1000, help="cases per input (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", default=",".join(TARGETS), help="comma-separated subset")
    p.add_argument("--json", metavar="OUT", default="fuzz_report.json")
    args = p.parse_args(argv)
    names = [x for x in args.inputs.split(",") if x]
    bad = [x for x in names if x not in TARGETS]
    if bad:
        p.error(f"--inputs: {bad} not available; available: {list(TARGETS)}")
    report = {
        "schema": REPORT_SCHEMA,
        "examples_per_input": args.examples,
        "seed": args.seed,
        "inputs": {},
        "not_available": sorted(set(ALL_TARGETS) - set(TARGETS)),
    }
    for name in names:
        report["inputs"][name] = r = fuzz_one(name, args.examples, args.seed)
        print(
            f"{name:14s} {r['cases']:6d} cases: {r['accepted']:6d} accepted, "
            f"{r['rejected']:6d} rejected, {r['unhandled']:3d} unhandled  ({r['wall_s']:.1f} s)"
        )
        for kind, k in r.get("kinds", {}).items():
            print(
                f"  {kind:14s} {k['cases']:5d} cases: {k['accepted']:5d} accepted, "
                f"{k['rejected']:5d} rejected, {k['mishandled']:3d} mishandled"
            )
    report["total_cases"] = sum(r["cases"] for r in report["inputs"].values())
    report["total_unhandled"] = sum(r["unhandled"] for r in report["inputs"].values())
    report["total_mishandled"] = report["total_unhandled"]  # the word for the same
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"total {report['total_cases']} cases, {report['total_unhandled']} unhandled -> {args.json}"
    )
    return 1 if report["total_unhandled"] else 0


if __name__ == "__main__":
    sys.exit(main())
