"""Schema 3: the job's 4-D layout fields in a plan (docs/plan-format.md). A plan without them
is written as schema 2, byte for byte as before; one with them round-trips exactly, and bad
values are refused naming the field."""

import json

import pytest

from dcp_opt.errors import PlanFormatError
from dcp_opt.plan import Group, MicroBatch, Phase, Pipeline, Plan


def _plan(**layout) -> Plan:
    mbs = (MicroBatch((0, 1), 2, (1, 1)), MicroBatch((2,), 0, (0, 0)))
    group = Group(0, 2, mbs)
    return Plan((Phase((group,)),), num_ranks=2, loss_normalizer=3.0, **layout)


def test_a_plan_without_layout_is_written_as_schema_2():
    plain = Plan((Phase((Group(0, 2, (MicroBatch((0,), 1),)),)),), 2, 1.0)
    d = plain.to_dict()
    assert d["schema_version"] == 2
    assert not {"tensor_parallel", "shard_domain", "pipeline"} & set(d)
    assert "stage_recompute" not in d["phases"][0]["groups"][0]["micro_batches"][0]


@pytest.mark.parametrize(
    "layout",
    [
        {"tensor_parallel": 4},
        {"shard_domain": 8},
        {"pipeline": Pipeline((3, 5), "interleaved", 2)},
        {"tensor_parallel": 2, "shard_domain": 4, "pipeline": Pipeline((4, 4))},
    ],
)
def test_layout_fields_round_trip_as_schema_3(layout):
    plan = _plan(**layout)
    d = json.loads(plan.to_json())
    assert d["schema_version"] == 3
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.content_hash() == plan.content_hash()
    assert back.phases[0].groups[0].micro_batches[0].stage_recompute == (1, 1)


def test_layout_changes_the_content_hash():
    assert _plan().content_hash() != _plan(tensor_parallel=2).content_hash()


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("tensor_parallel", 0, "plan.tensor_parallel"),
        ("tensor_parallel", True, "plan.tensor_parallel"),
        ("shard_domain", -1, "plan.shard_domain"),
        ("pipeline", {"stage_layers": []}, "plan.pipeline.stage_layers"),
        ("pipeline", {"stage_layers": [2, 0]}, "plan.pipeline.stage_layers"),
        ("pipeline", {"stage_layers": [2], "schedule": "zb"}, "plan.pipeline.schedule"),
        ("pipeline", {"stage_layers": [2], "virtual_stages": 0}, "plan.virtual_stages"),
    ],
)
def test_bad_layout_values_name_the_field(key, value, field):
    d = _plan(tensor_parallel=2).to_dict()
    d[key] = value
    with pytest.raises(PlanFormatError, match=field.replace(".", r"\.")):
        Plan.from_dict(d)


def test_stage_recompute_must_be_integers():
    d = _plan().to_dict()
    d["phases"][0]["groups"][0]["micro_batches"][0]["stage_recompute"] = [1.5]
    with pytest.raises(PlanFormatError, match="stage_recompute"):
        Plan.from_dict(d)
