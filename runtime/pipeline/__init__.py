"""Pipeline parallelism at run time (issue 30): stages from the model's own layers, the
schedules of `dcp_opt.pipeline` on point-to-point transfers with shapes first, composed with
the plan's SP groups inside every stage.

    model = parallelize(TinyLM(cfg), state)            # or parallelize_hf(llama, state)
    stage = build_stage(model, plan.pipeline.stage_layers, rank // plan.num_ranks)
    report = execute_step(plan, task, stage, data, pool=pool, state=state, step=i)

`execute_step` (runtime/executor.py) hands a plan with a pipeline to `execute_pipeline_step`.
"""

from .checks import PipelinePlanError, check_stage_recompute
from .executor import ActionTime, PipelineStepReport, execute_pipeline_step
from .p2p import Channel
from .stages import PipelineStage, StageSplitError, build_stage, global_view, model_layers

__all__ = [
    "ActionTime",
    "Channel",
    "PipelinePlanError",
    "PipelineStage",
    "PipelineStepReport",
    "StageSplitError",
    "build_stage",
    "check_stage_recompute",
    "execute_pipeline_step",
    "global_view",
    "model_layers",
]
