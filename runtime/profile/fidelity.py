"""Worker side of the fidelity benchmark (benchmarks/bench_fidelity.py): each rank builds the
runtime's TinyLM, then executes plans with the runtime's executor and reports step and
micro-batch times. Functions take a `runtime.testing.WorkerContext` first, as
`DistWorkers.run` calls them; module globals hold the model between calls (one per process).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dcp_opt.batch import Batch
from dcp_opt.plan import Plan

from ..executor import execute_step
from ..models import LMConfig, TinyLM
from ..parallelize import SPState, parallelize
from ..tasks import LMTask
from .fit import measure_all_to_all

_STATE: dict = {}


def setup_lm(ctx, cfg: dict, seed: int = 0) -> int:
    """Build and parallelize TinyLM(LMConfig(**cfg)); returns its parameter count."""
    torch.manual_seed(seed)
    state = SPState()
    model = parallelize(TinyLM(LMConfig(**cfg)), state)
    _STATE.update(model=model, state=state, vocab=cfg["vocab_size"], task=LMTask())
    return sum(p.numel() for p in model.parameters())


def setup_hf(ctx, ref: str, seed: int = 0) -> int:
    """Build the Hugging Face causal LM of config `ref` (runtime/profile/hf.py's forms; random
    weights, float32, nothing downloaded) and parallelize it; returns its parameter count."""
    from transformers import AutoModelForCausalLM

    from ..hf import HFCausalLMTask, parallelize_hf
    from .hf import load_hf_config

    config = load_hf_config(ref)
    torch.manual_seed(seed)
    state = SPState()
    model = parallelize_hf(AutoModelForCausalLM.from_config(config), state)
    _STATE.update(model=model, state=state, vocab=config.vocab_size, task=HFCausalLMTask())
    return sum(p.numel() for p in model.parameters())


def measure_a2a(ctx):
    return measure_all_to_all(None)


def measure_grad_sync(ctx, num_params: int, repeats: int = 5) -> float:
    """Median seconds of one all-reduce of a flat fp32 buffer of every gradient."""
    buf = torch.ones(num_params)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if i:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(statistics.median(times))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _data(batch: Batch, vocab: int, seed: int):
    def get(sid: int) -> torch.Tensor:
        n = batch.by_id[sid].shape[0]
        g = torch.Generator().manual_seed(seed * 1_000_003 + sid)
        return torch.randint(0, vocab, (n + 1,), generator=g)

    return get


class CpuTimedTask:
    """Wraps a task: records the calling thread's CPU time of every micro-batch (the executor
    calls task.run once per micro-batch, in the order of its report). With one intra-op
    thread, forward and backward run on this thread; gloo's transfers run on gloo's threads
    and waiting for a peer costs no CPU time, so this is the compute a rank did, whatever
    other processes do to the shared cores."""

    def __init__(self, task):
        self.task, self.cpu_s = task, []

    def run(self, *args, **kwargs):
        t0 = time.thread_time()
        out = self.task.run(*args, **kwargs)
        self.cpu_s.append(time.thread_time() - t0)
        return out


def run_plan(ctx, plan_json: str, batch_dict: dict, steps: int, warmup: int) -> dict:
    """Execute the plan `warmup + steps` times; this rank's timed steps and micro-batches
    as (phase, start rank, degree, index, sequence ids, recompute, wall s, CPU s)."""
    plan, batch = Plan.from_json(plan_json), Batch.from_dict(batch_dict)
    model, state = _STATE["model"], _STATE["state"]
    data = _data(batch, _STATE["vocab"], 0)
    out = {"step_s": [], "grad_sync_s": [], "check_s": [], "micro_batches": []}
    for step in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        task = CpuTimedTask(_STATE["task"])
        rep = execute_step(plan, task, model, data, pool=ctx.pool, state=state, step=step)
        if step < warmup:
            continue
        out["step_s"].append(rep.step_time_s)
        out["grad_sync_s"].append(rep.grad_sync_s)
        out["check_s"].append(rep.check_s)
        out["micro_batches"].append(
            [
                (
                    m.phase,
                    m.start_rank,
                    m.degree,
                    m.index,
                    list(m.sequence_ids),
                    m.recompute_layers,
                    m.seconds,
                    cpu,
                )
                for m, cpu in zip(rep.micro_batches, task.cpu_s, strict=True)
            ]
        )
    return out


def worker_run_plan(workers):
    """`run_plan(plan, batch, steps, warmup)` for runtime.profile.measure.calibrate_runtime: executes
    on every rank of a DistWorkers pool whose model was built by `setup_lm`."""

    def run(plan, batch, steps, warmup):
        return workers.run(run_plan, plan.to_json(), batch.to_dict(), steps, warmup)

    return run


def calibrate_tiny_lm(profile, cfg: dict, world: int):
    """`profile` (of runtime.models.TinyLM(LMConfig(**cfg))) with a runtime calibration
    measured in `world` local gloo processes (one thread each): the hook for
    `dcp-opt profile --calibrate-world N`."""
    return _calibrate(profile, world, setup_lm, cfg)


def calibrate_hf(profile, ref: str, world: int):
    """The same for the Hugging Face model of config `ref` (`dcp-opt profile --model hf:...
    --calibrate-world N`): the whole model runs on every rank through parallelize_hf, so its
    per-micro-batch and per-step overheads are the runtime's own (issue 28: a profile of an
    HF model predicted 0.014 s for steps measured at 0.2-0.4 s without them)."""
    return _calibrate(profile, world, setup_hf, ref)


def _calibrate(profile, world: int, setup, what):
    from ..testing import DistWorkers
    from .measure import calibrate_runtime

    workers = DistWorkers(world, timeout_s=300)
    try:
        workers.run(setup, what, 0)
        return calibrate_runtime(profile, worker_run_plan(workers), world=world)
    finally:
        workers.close()
