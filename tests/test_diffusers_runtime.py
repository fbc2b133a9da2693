"""diffusers video / image transformers (WanTransformer3DModel, HunyuanVideoTransformer3DModel,
FluxTransformer2DModel) built from their config classes with tiny random weights (nothing
downloaded), trained by one executor step of a hand-built plan (degree > 1, micro-batches of
mixed shapes, token counts not divisible by the degree) on gloo worlds of 2 and 4: the
gradient equals single-process training of the unmodified model on the same batch
(runtime/diffusers.py). Refusals name the field and leave the model unchanged."""

from __future__ import annotations

import pytest
import torch
from dcp_opt.runtime import SPState, execute_step
from dcp_opt.runtime.diffusers import UnsupportedModelError, parallelize_diffusers
from dcp_opt.runtime.diffusers_task import DiffusersTask
from dcp_opt.runtime.testing import (
    DistWorkers,
    flat_grads,
    reference_step,
)

from dcp_opt import Batch, Cluster, CostModel, ModelSpec, make_plan, validate
from dcp_opt.plan import Group, MicroBatch, Plan

TASK = DiffusersTask(seed=5)
C, TEXT_DIM, POOLED = 4, 16, 8
# Latent token shapes (frames, rows, columns) after patchifying: images and videos, several
# with a token count no degree divides.
SHAPES = [(1, 3, 1), (2, 1, 2), (1, 2, 2), (3, 1, 1), (1, 1, 3)]
# Wan computes its residual stream in float32 whatever the weights' dtype
# (transformer_wan.py:488-502, `hidden_states.float()` ... `.type_as(hidden_states)`), so
# its float64 run agrees to float32 rounding only; the others compute in float64 throughout.
TOL = {"wan": 1e-6, "hunyuan": 1e-9, "flux": 1e-9}


def make_model(name: str, seed: int = 0):
    import diffusers

    torch.manual_seed(seed)
    if name == "wan":
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=C,
            out_channels=C, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=24, num_layers=2,
            rope_max_seq_len=32,
        )  # fmt: skip
    elif name == "hunyuan":
        model = diffusers.HunyuanVideoTransformer3DModel(
            in_channels=C, out_channels=C, num_attention_heads=3, attention_head_dim=12,
            num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
            patch_size=1, patch_size_t=1, guidance_embeds=False, text_embed_dim=TEXT_DIM,
            pooled_projection_dim=POOLED, rope_axes_dim=(4, 4, 4),
        )  # fmt: skip
    else:
        model = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=C, num_layers=1, num_single_layers=1,
            attention_head_dim=8, num_attention_heads=3, joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=POOLED, guidance_embeds=False, axes_dims_rope=(4, 2, 2),
        )  # fmt: skip
    for p in model.parameters():  # zero-initialised gates / outputs would hide errors
        torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(p.numel()))
    return model.double()


def make_sample(name: str, shape, sid: int) -> dict:
    g = torch.Generator().manual_seed(100 + sid)
    f, h, w = shape
    text = torch.randn(2 + sid % 3, TEXT_DIM, generator=g, dtype=torch.float64)
    out = {"text": text, "pooled": torch.randn(POOLED, generator=g, dtype=torch.float64)}
    if name == "flux":  # packed image tokens and their (0, row, column) ids
        out["x"] = torch.randn(h * w, C, generator=g, dtype=torch.float64)
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        ids = torch.stack([torch.zeros(h * w), rows.reshape(-1), cols.reshape(-1)], dim=-1)
        out["img_ids"] = ids.double()
        return out
    scale = 2 if name == "wan" else 1  # Wan patches 2 x 2 pixels of the latent
    out["x"] = torch.randn(C, f, h * scale, w * scale, generator=g, dtype=torch.float64)
    return out


def shapes_for(name: str):
    return [(1, s[1], s[2] * s[0]) for s in SHAPES] if name == "flux" else SHAPES


def hand_plan(world: int, name: str) -> tuple[Plan, Batch]:
    """Phase 0: the whole world as one group, two micro-batches (one of three samples of
    mixed shapes); phase 1: a group of degree 2 with two samples, the rest alone or idle."""
    batch = Batch.from_shapes(shapes_for(name))
    mb = MicroBatch
    second = [Group(0, 2, (mb((3, 4), 0),))]
    second += [Group(2, 1, ()), Group(3, 1, ())] if world == 4 else []
    phases = [[Group(0, world, (mb((0, 1, 2), 0),))], second]
    cost = CostModel(
        ModelSpec("tiny", "2d", 2, 36, 3, 24, text_tokens=3, causal=False),
        Cluster("cpu", 1, world, 1e15, 1e12, 1e10, 1e10),
    )
    plan = make_plan(phases, batch, cost, planner="hand", normalizer_kind="tokens")
    assert validate(plan, batch, cost) == []
    return plan, batch


def job_step(ctx, name, plan_json, batch_dict, recompute):
    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    model, state = make_model(name), SPState()
    parallelize_diffusers(model, state)
    data = {s.id: make_sample(name, s.shape, s.id) for s in batch.sequences}
    if recompute:
        plan = _with_recompute(plan)
    report = execute_step(plan, TASK, model, data, pool=ctx.pool, state=state, step=2)
    return report.loss, flat_grads(model)


def _with_recompute(plan: Plan) -> Plan:
    import dataclasses

    phases = [
        dataclasses.replace(
            ph,
            groups=tuple(
                dataclasses.replace(
                    g,
                    micro_batches=tuple(
                        dataclasses.replace(m, recompute_layers=1) for m in g.micro_batches
                    ),  # fmt: skip
                )
                for g in ph.groups
            ),
        )
        for ph in plan.phases
    ]
    return dataclasses.replace(plan, phases=tuple(phases))


def grad_error(got, want) -> float:
    """max over parameters of ||got - want|| / ||want||, where ||want|| is floored at 1e-6 of
    the whole gradient's norm: a key projection's bias has a gradient of zero in exact
    arithmetic (softmax ignores a shift common to a query's scores), ~1e-17 in float64, and
    its relative error is rounding over rounding."""
    floor = 1e-6 * float(torch.cat([w.reshape(-1) for w in want]).norm())
    return max(
        float((g - w).norm()) / max(float(w.norm()), floor) for g, w in zip(got, want, strict=True)
    )


def reference(name: str, plan: Plan):
    model = make_model(name)
    items = [(i, make_sample(name, s, i)) for i, s in enumerate(shapes_for(name))]
    loss = reference_step(
        TASK, model, items, step=2, kind=plan.normalizer_kind, normalizer=plan.loss_normalizer
    )
    return loss, flat_grads(model)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def workers(request):
    w = DistWorkers(request.param, timeout_s=120.0)
    yield w
    w.close()


@pytest.mark.parametrize("name", ["wan", "hunyuan", "flux"])
def test_plan_step_equals_single_process_training(workers, name):
    plan, batch = hand_plan(workers.world_size, name)
    recompute = name == "hunyuan"  # one family also recomputes its first block
    results = workers.run(job_step, name, plan.to_json(), batch.to_dict(), recompute)
    want_loss, want = reference(name, plan)
    for loss, grads in results:
        assert abs(loss - want_loss) <= TOL[name] * abs(want_loss), (loss, want_loss)
        err = grad_error(grads, want)
        assert err <= TOL[name], f"{name} world {workers.world_size}: gradient error {err:.3e}"
        print(f"{name} world {workers.world_size}: max relative gradient error {err:.2e}")


# ---- refusals: named field, model unchanged ------------------------------------------------
def snapshot(model) -> tuple:
    """Everything parallelize_diffusers could change: weights, processors, hooks, forwards."""
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    procs = dict(model.attn_processors)
    hooks = [
        (len(m._forward_pre_hooks), len(m._forward_hooks), "forward" in vars(m))
        for m in model.modules()
    ]
    return weights, procs, hooks


def assert_unchanged(model, before) -> None:
    weights, procs, hooks = snapshot(model)
    assert weights.keys() == before[0].keys()
    assert all(torch.equal(weights[k], before[0][k]) for k in weights)
    assert all(procs[k] is before[1][k] for k in procs) and procs.keys() == before[1].keys()
    assert hooks == before[2]


def refused(model, match: str) -> None:
    before = snapshot(model)
    with pytest.raises(UnsupportedModelError, match=match):
        parallelize_diffusers(model, SPState(), sync_weights=False)
    assert_unchanged(model, before)


def test_an_unverified_family_is_refused():
    import diffusers

    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=C, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, caption_projection_dim=16,
        pooled_projection_dim=POOLED, out_channels=C, pos_embed_max_size=8,
    )  # fmt: skip
    refused(model, r"model: 'SD3Transformer2DModel' not supported .* allowed: \[")


def test_wan_image_to_video_inputs_are_refused():
    import diffusers

    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=C,
        out_channels=C, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=24, num_layers=1,
        image_dim=8, added_kv_proj_dim=24,
    )  # fmt: skip
    refused(model, "image_dim: 8 not supported")


def test_another_processor_is_refused():
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    model = make_model("flux")
    procs = dict(model.attn_processors)
    key = "transformer_blocks.0.attn.processor"
    procs[key] = FluxIPAdapterAttnProcessor(24, 24, num_tokens=(4,), scale=1.0).double()
    model.set_attn_processor(procs)
    refused(
        model, rf"{key}: 'FluxIPAdapterAttnProcessor' not supported.*allowed: FluxAttnProcessor"
    )


def test_diffusers_own_checkpointing_and_a_second_call_are_refused():
    model = make_model("hunyuan")
    model.enable_gradient_checkpointing()
    refused(model, "gradient_checkpointing: True not supported")
    model.disable_gradient_checkpointing()
    parallelize_diffusers(model, SPState(), sync_weights=False)
    refused(model, "model: 'HunyuanVideoTransformer3DModel' not supported .*already")


def test_dropout_is_refused():
    model = make_model("wan")
    model.blocks[0].ffn.net[1] = torch.nn.Dropout(0.1)  # where a config's dropout would sit
    refused(model, r"dropout \(module blocks.0.ffn.net.1\): 0.1 not supported")


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"dropout_p": 0.1}, "dropout_p: 0.1"),
        ({"is_causal": True}, "is_causal"),
        ({"attn_mask": torch.tensor([True, False])}, "attention_mask: padded captions"),
    ],
)
def test_an_sdpa_call_it_cannot_run_exactly_raises(kw, match):
    from dcp_opt.runtime.diffusers import ShardRecord, UlyssesSDPA

    q = torch.zeros(1, 2, 2, 4)
    mode = UlyssesSDPA(SPState(), ShardRecord(), ("video",), cross=False)
    with pytest.raises(ValueError, match=match), mode:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, **kw)
