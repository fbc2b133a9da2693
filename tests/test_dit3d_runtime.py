"""The 3-D full-attention DiTs (runtime/models.py TinyMMDiT, TinyWanDiT) under Ulysses over
the joint sequence (runtime/joint.py): one executor step of a hand-built plan (degree > 1,
packed micro-batches of images and videos of mixed shapes) on gloo worlds of 2 and 4 gives
the gradient of single-process training on the same batch, float64, to 1e-9."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import (
    Full3DConfig,
    JointDiffusionTask,
    SPState,
    TinyMMDiT,
    TinyWanDiT,
    execute_step,
    parallelize,
)
from dcp_opt.runtime.joint import JointLayout, joint_attention
from dcp_opt.runtime.sp import SPGroup
from dcp_opt.runtime.testing import DistWorkers, flat_grads, max_relative_error, reference_step

from dcp_opt import Batch, Cluster, CostModel, ModelSpec, make_plan, validate
from dcp_opt.plan import Group, MicroBatch, Plan

TOL = 1e-9
CFG = Full3DConfig(in_channels=3, hidden=36, num_heads=3, num_double=1, num_single=1)
MODELS = {"mmdit": TinyMMDiT, "wan": TinyWanDiT}
TASK = JointDiffusionTask(seed=11)
# images (F = 1) and videos of mixed shapes; caption lengths differ per sample
SHAPES = [(1, 2, 3), (3, 2, 2), (1, 1, 1), (2, 3, 1), (4, 1, 2), (1, 3, 3), (2, 2, 2)]
SPEC = ModelSpec("tiny-3d", "2d", 2, 36, 3, 32, text_tokens=3, causal=False)


def text_tokens(sid: int) -> int:
    return 2 + sid % 3


def make_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return MODELS[name](CFG).double()


def make_data(batch: Batch, seed: int = 1) -> dict:
    out = {}
    for s in batch.sequences:
        g = torch.Generator().manual_seed(seed * 1000 + s.id)
        x = torch.randn(*s.shape, CFG.in_channels, generator=g, dtype=torch.float64)
        text = torch.randn(text_tokens(s.id), CFG.text_dim, generator=g, dtype=torch.float64)
        out[s.id] = {"x": x, "text": text}
    return out


def hand_plan(world: int, kind: str) -> tuple[Plan, Batch]:
    """Phase 0: the whole world as one group (degree = world) with two packed micro-batches;
    phase 1: groups of degree 2 (and one of degree 1 at world 4), packed too."""
    batch = Batch.from_shapes(SHAPES)
    mb = MicroBatch
    if world == 2:
        phases = [
            [Group(0, 2, (mb((1, 0, 2), 0), mb((3,), 1)))],
            [Group(0, 1, (mb((4, 5), 0),)), Group(1, 1, (mb((6,), 2),))],
        ]
    else:
        phases = [
            [Group(0, 4, (mb((1, 0), 0), mb((3, 2), 1)))],
            [Group(0, 2, (mb((4, 5), 0),)), Group(2, 1, (mb((6,), 2),)), Group(3, 1, ())],
        ]
    cluster = Cluster("cpu", 1, world, 1e15, 1e12, 1e10, 1e10)
    cost = CostModel(SPEC, cluster)
    plan = make_plan(phases, batch, cost, planner="hand", normalizer_kind=kind)
    assert validate(plan, batch, cost) == []
    return plan, batch


def job_step(ctx, name, plan_json, batch_dict, step):
    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    model, state = make_model(name), SPState()
    parallelize(model, state)
    report = execute_step(
        plan, TASK, model, make_data(batch), pool=ctx.pool, state=state, step=step, batch=batch
    )
    return report.loss, flat_grads(model)


def reference(name: str, plan: Plan, batch: Batch, step: int):
    model = make_model(name)
    items = sorted(make_data(batch).items())
    loss = reference_step(
        TASK, model, items, step=step, kind=plan.normalizer_kind, normalizer=plan.loss_normalizer
    )
    return loss, flat_grads(model)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def workers(request):
    w = DistWorkers(request.param, timeout_s=120.0)
    yield w
    w.close()


@pytest.mark.parametrize("kind", ["tokens", "samples"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_plan_step_equals_single_process_training(workers, name, kind):
    plan, batch = hand_plan(workers.world_size, kind)
    results = workers.run(job_step, name, plan.to_json(), batch.to_dict(), 3)
    want_loss, want = reference(name, plan, batch, 3)
    for loss, grads in results:
        assert abs(loss - want_loss) <= TOL * abs(want_loss), (loss, want_loss)
        err = max_relative_error(grads, want)
        assert err <= TOL, f"{name} world {workers.world_size}: gradient error {err:.3e}"
        print(f"{name} world {workers.world_size} {kind}: max relative gradient error {err:.2e}")
        assert all(float(g.norm()) > 0 for g in grads)  # every weight is trained


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_packed_micro_batch_is_block_diagonal(name):
    """One packed forward of mixed shapes equals each sample alone: a sample's attention
    sees only its own tokens (and, for the MMDiT, only its own caption)."""
    model = make_model(name)
    data = make_data(Batch.from_shapes(SHAPES))
    ids = sorted(data)
    layout = JointLayout(
        tuple(SHAPES), tuple(text_tokens(i) for i in ids), joint=model.joint
    )  # fmt: skip
    t = torch.linspace(0.1, 0.9, len(ids), dtype=torch.float64)
    x = torch.cat([data[i]["x"].reshape(-1, CFG.in_channels) for i in ids])
    packed = model(x, t, torch.cat([data[i]["text"] for i in ids]), layout)
    alone = [model(data[i]["x"], t[i], data[i]["text"]).reshape(-1, CFG.in_channels) for i in ids]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-12, atol=1e-12)


def test_another_caption_changes_only_its_own_sample():
    """The block-diagonal test above can fail: change sample 1's caption and only sample 1's
    prediction moves."""
    model = make_model("mmdit")
    data = make_data(Batch.from_shapes(SHAPES[:3]))
    layout = JointLayout(tuple(SHAPES[:3]), tuple(text_tokens(i) for i in range(3)))
    t = torch.tensor([0.2, 0.5, 0.7], dtype=torch.float64)
    x = torch.cat([data[i]["x"].reshape(-1, CFG.in_channels) for i in range(3)])
    texts = [data[i]["text"] for i in range(3)]
    before = model(x, t, torch.cat(texts), layout)
    texts[1] = texts[1] + 1.0
    after = model(x, t, torch.cat(texts), layout)
    sizes = [f * h * w for f, h, w in SHAPES[:3]]
    moved = [
        bool((a - b).abs().max() > 1e-6)
        for a, b in zip(after.split(sizes), before.split(sizes), strict=True)
    ]
    assert moved == [False, True, False]


def test_a_config_without_a_3d_rope_width_is_refused():
    # head width 5: odd (rope3d rotates pairs; 8 is fine since Wan's 4 + 2 + 2 split)
    with pytest.raises(ValueError, match="hidden: 20 with num_heads 4"):
        Full3DConfig(hidden=20, num_heads=4)


def test_layout_of_another_degree_is_refused():
    layout = JointLayout(((1, 2, 2),), (3,), degree=2, rank=0)
    q = torch.zeros(layout.text_shard + layout.video_shard, 2, 4)
    with pytest.raises(ValueError, match="layout: built for degree 2"):
        joint_attention(q, q, q, layout, SPGroup.single())


@pytest.mark.parametrize(
    "shapes, texts, match",
    [((), (), "shapes: 0 samples"), (((1, 0, 2),), (2,), "shapes:"), (((1, 2),), (2,), "shapes:")],
)
def test_bad_layouts_name_the_field(shapes, texts, match):
    with pytest.raises(ValueError, match=match):
        JointLayout(shapes, texts)


def test_model_spec_refuses_a_3d_model_by_name():
    from dcp_opt.runtime.models import model_spec

    with pytest.raises(ValueError, match="cfg: TinyWanDiT not allowed"):
        model_spec(TinyWanDiT(CFG))
