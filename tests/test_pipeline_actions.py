"""The per-stage action lists (dcp_opt/pipeline.py) against their definitions, by hand."""

import pytest

from dcp_opt.errors import DcpOptError
from dcp_opt.pipeline import stage_actions


def _text(actions) -> str:
    return " ".join(map(str, actions))


def test_1f1b_by_hand():
    # p = 3, m = 4: stage 0 warms up with p - 1 = 2 forwards, the last stage with none.
    assert _text(stage_actions("1f1b", 3, 4, 0)) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert _text(stage_actions("1f1b", 3, 4, 1)) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _text(stage_actions("1f1b", 3, 4, 2)) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_1f1b_with_fewer_micro_batches_than_stages():
    assert _text(stage_actions("1f1b", 4, 2, 0)) == "F0 F1 B0 B1"
    assert _text(stage_actions("1f1b", 4, 0, 0)) == ""


def test_gpipe_by_hand():
    assert _text(stage_actions("gpipe", 2, 3, 1)) == "F0 F1 F2 B2 B1 B0"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 3), (8, 16)])
def test_every_pass_once_forward_before_backward(schedule, p, m):
    for s in range(p):
        acts = stage_actions(schedule, p, m, s)
        assert sorted((a.kind, a.micro_batch) for a in acts) == sorted(
            [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
        )
        seen = set()
        for a in acts:
            assert a.kind == "F" or a.micro_batch in seen
            seen.add(a.micro_batch)


def test_1f1b_in_flight_at_most_p_minus_s():
    p, m = 4, 9
    for s in range(p):
        live = peak = 0
        for a in stage_actions("1f1b", p, m, s):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(p - s, m)


@pytest.mark.parametrize(
    "args,field",
    [
        (("zb", 2, 2, 0), "schedule"),
        (("1f1b", 0, 2, 0), "num_stages"),
        (("1f1b", 2, -1, 0), "num_micro_batches"),
        (("1f1b", 2, 2, 2), "stage"),
    ],
)
def test_bad_arguments_name_the_field(args, field):
    with pytest.raises(DcpOptError, match=field):
        stage_actions(*args)
