"""`megatron_hybrid_cp`: the released Megatron-Core's hybrid-CP scheduler, called.

The decisions are the package's by construction: `megatron-core` from the package index
(the `megatron` extra, 0.16.x), `megatron.core.pipeline_parallel.hybrid_cp_schedule.
BalancedCPScheduler(max_seq_len_per_rank, dp_cp_group).get_groups_and_subsamples(
[(id, length)], config)`, as `HybridCPDataLoaderWrapper` calls it (megatron/core/datasets/
data_schedule.py in the release). The process group is a stand-in whose `size()` is the
number of ranks, the one thing the scheduler reads of it (its __init__); no
torch.distributed. This is the released algorithm (bucketed `next_hdp_group`, the pre-#5154
one), not dev's packing-aware one (`megatron_dynamic_cp`).

The plan around the decisions is megatron_dynamic_cp's (megatron.py: options
max_seqlen_per_rank, recompute, pad_to_multiple_of, kind; aligned groups; a pack over the
memory gets the fewest recomputed layers that fit, counted in stats["oom_micro_batches"]).
On a rank count that is not a power of two the package raises IndexError (its
fill_empty_gpus shifts ranks past the last one), so it schedules the largest power of two of
ranks and the others idle (a deviation where the package cannot run). Without the extra the
planner is refused with the install line.
"""

from __future__ import annotations

import importlib
import time
import warnings

from dcp_opt.batch import Batch
from dcp_opt.cost import CostModel
from dcp_opt.errors import DcpOptError, InfeasibleError
from dcp_opt.result import PlanResult

from .megatron import padded_lengths, plan_of_steps, resolve_settings

MODULE = "megatron.core.pipeline_parallel.hybrid_cp_schedule"
INSTALL = 'pip install -e ".[megatron]"'


class RankGroup:
    """The DPxCP process group as the scheduler sees it: its size."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks

    def size(self) -> int:
        return self.num_ranks


def released_scheduler_class():
    """`BalancedCPScheduler` of the installed megatron-core; DcpOptError if absent."""
    try:
        with warnings.catch_warnings():  # scheduling needs neither TransformerEngine nor Apex
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
            module = importlib.import_module(MODULE)
    except ImportError as e:
        raise DcpOptError(
            f"megatron_hybrid_cp: needs the released Megatron-Core ({MODULE}), not importable "
            f"here ({e}); install the extra: {INSTALL}"
        ) from None
    return module.BalancedCPScheduler


def plan_megatron_hybrid_cp(
    batch: Batch,
    cost: CostModel,
    *,
    seed: int = 0,
    max_seqlen_per_rank: int | None = None,
    pad_to_multiple_of: int | None = None,
    recompute: str | None = None,
    kind: str | None = None,
) -> PlanResult:
    """The released BalancedCPScheduler's groups and micro-steps of `batch` (module doc)."""
    t0 = time.perf_counter()
    scheduler_class = released_scheduler_class()
    cost.check_fits(batch)
    st = resolve_settings(
        batch, cost, max_seqlen_per_rank=max_seqlen_per_rank, recompute=recompute,
        pad_to_multiple_of=pad_to_multiple_of, kind=kind,
    )  # fmt: skip
    n = 1 << (cost.cluster.num_gpus.bit_length() - 1)  # module doc: power-of-two ranks
    group = RankGroup(n)
    scheduler = scheduler_class(max_seq_len_per_rank=st.max_seqlen_per_rank, dp_cp_group=group)
    try:
        _, steps = scheduler.get_groups_and_subsamples(
            padded_lengths(batch, st.pad_to_multiple_of), None
        )
    except AssertionError as e:  # e.g. a sequence over n x max_seqlen_per_rank
        raise InfeasibleError(f"megatron_hybrid_cp: the released scheduler refuses: {e}") from None
    stats = {"scheduled_ranks": n}
    return plan_of_steps(
        steps, batch, cost, st, planner="megatron_hybrid_cp", started=t0, stats=stats
    )
