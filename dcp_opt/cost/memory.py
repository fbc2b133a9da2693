"""Memory per GPU: model states under the optimizer-sharding mode, the reserve, and a
micro-batch's activations at degree d with r recomputed layers (Korthikanti et al. 2022,
sec. 4; the package docstring); the fewest recomputed layers that fit."""

from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..errors import InfeasibleError, format_bytes
from . import cp as cp_cost
from . import ring as ring_cost
from . import settings, zero3

SHARDING_MODES = ("none", "zero1", "zero2", "zero3")


class Memory:
    """CostModel's memory (a mixin: reads the fields of dcp_opt.cost.model)."""

    def model_state_bytes(self) -> float:
        """Peak model-state bytes per GPU in a step as runtime/sharding.py runs the mode
        (docs/architecture.md, "Sharded, mixed-precision training"). The world reduces the
        gradients once per step, since groups run different numbers of micro-batches; until
        then every rank holds the gathered bf16 weights and a full fp32 accumulator. So zero2
        and zero3 hold the zero1 peak: only the fp32 master weights and moments are sharded.
        Per unit (tensor_parallel GPUs; cost/units.py): a GPU holds 1/t. Under per-layer zero3
        (shard_domain > 0) the states of cost/zero3.py."""
        if self.shard_domain:
            return sum(zero3.state_parts(self.model, self.shard_domain).values())
        p, n = self.model.total_params, self.cluster.num_gpus
        w, g, o = 2.0, 4.0, 12.0
        if self.optimizer_sharding != "none":
            o /= n
        return p * (w + g + o)

    def fixed_bytes(self) -> float:
        return self.model_state_bytes() + self.coeffs.reserved_bytes

    def _act_bytes(self, d, kind: str):
        """Saved bytes per local token per layer: the coefficient, plus under cp the
        gathered K/V of the other members (cp_cost.extra_act_bytes); ring keeps Ulysses'."""
        act = self.coeffs.act_bytes_per_token_layer + self._tp_gathered_input_bytes()
        if kind == "ulysses":
            return act
        cp_cost.check_kind(self.model, kind)
        if kind == "ring":
            return act
        return act + cp_cost.extra_act_bytes(self.model, d)

    def _tp_gathered_input_bytes(self) -> float:
        """Per unit, local token and kept layer, what torch's DTensor TP saves beyond 1/t of
        the activations: the column-parallel projections (qkv, the MLP's first) save their
        all-gathered input whole, 2 h c (t - 1) per unit (each of the t GPUs holds (t - 1)/t
        more than its shard of 2 h c). Measured: tests/test_memory_layouts.py (bench_memory
        tp_saved_term); Megatron's sequence parallelism instead re-gathers it in backward
        (Korthikanti et al. 2022 sec. 4.2.2), which this runtime does not."""
        t = self.tensor_parallel
        if t == 1:
            return 0.0
        return 2.0 * self.model.hidden * self.model.dtype_bytes * (t - 1)

    def _head_bytes(self, d, kind: str):
        """Bytes per local token held once (not per layer): the head's, plus under ring the
        working layer's ring buffers (ring_cost.buffer_bytes)."""
        # x t under TP: the head returns whole logits (no loss parallelism), so each GPU of a
        # unit holds a whole head term (tests/test_memory_layouts.py)
        head = self.coeffs.head_bytes_per_token * self.tensor_parallel
        return head + ring_cost.buffer_bytes(self.model, d) if kind == "ring" else head

    def saved_activation_bytes(self, tokens, d, recompute_layers=0, kind="ulysses"):
        """Per unit, the bytes autograd saves for a micro-batch of `tokens` on a degree-d
        group: T/d ((L - r) act + r ckpt + head), without memory()'s one-layer working set
        (benchmarks/bench_memory.py measures this part; a GPU of a unit holds 1/t)."""
        co, L = self.coeffs, self.model.num_layers
        r = np.asarray(recompute_layers, dtype=float)
        per = (L - r) * self._act_bytes(d, kind) + r * co.ckpt_bytes_per_token_layer
        return np.asarray(tokens, dtype=float) / d * (per + self._head_bytes(d, kind))

    def memory(self, tokens, d, recompute_layers=0, kind="ulysses"):
        """Peak bytes on each member of a degree-d group (elementwise over tokens, d, r)."""
        co, L = self.coeffs, self.model.num_layers
        r = np.asarray(recompute_layers, dtype=float)
        act = self._act_bytes(d, kind)
        per_token = (
            (L - r) * act + r * co.ckpt_bytes_per_token_layer + act + self._head_bytes(d, kind)
        )
        return self.fixed_bytes() + np.asarray(tokens, dtype=float) / d * per_token

    def capacity(self, start: int = 0, degree: int = 1) -> float:
        return self.cluster.group_memory(start, degree) * self.usable_memory_fraction

    def min_recompute(self, tokens, d, capacity=None, kind="ulysses"):
        """Fewest recomputed layers that fit; -1 where even r = L does not fit. Elementwise:
        tokens (n,) with a column of degrees and their capacities (D, 1) give (D, n)."""
        cap = self.capacity() if capacity is None else capacity
        co, L = self.coeffs, self.model.num_layers
        t = np.asarray(tokens, dtype=float) / d
        room = cap - self.fixed_bytes()
        act = self._act_bytes(d, kind)
        base = t * ((L + 1) * act + self._head_bytes(d, kind))
        saved_per_layer = t * (act - co.ckpt_bytes_per_token_layer)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.ceil((base - room) / np.maximum(saved_per_layer, 1e-30) - 1e-9)
        r = np.maximum(need, 0)  # np.clip costs more per call
        return np.where((r <= L) & (room > 0), r, -1).astype(int)

    def micro_batch_memory(self, tokens, d, recompute_layers, kinds) -> np.ndarray:
        """memory() of micro-batches of groups of several SP kinds (`kinds`: one per
        micro-batch). A kind this cost model does not offer is priced as Ulysses: validate()
        reports such a group as BAD_KIND, and its memory is not the question then."""
        need = self.memory(tokens, d, recompute_layers)
        for k in self.sp_kinds[1:]:  # cp, ring: where offered
            mine = np.asarray(kinds) == k
            if mine.any():
                need = np.where(mine, self.memory(tokens, d, recompute_layers, k), need)
        return need

    def model_state_parts(self) -> dict[str, float]:
        """model_state_bytes() by part, bytes per unit: bf16 weights, fp32 gradient
        accumulator, fp32 master weights + Adam moments (sharded over the world unless
        `none`); under per-layer zero3 zero3.state_parts."""
        if self.shard_domain:
            return zero3.state_parts(self.model, self.shard_domain)
        p = self.model.total_params
        opt = 12.0 if self.optimizer_sharding == "none" else 12.0 / self.cluster.num_gpus
        return {"parameters": 2.0 * p, "gradients": 4.0 * p, "optimizer states": opt * p}

    def check_states_fit(self) -> None:
        """Raise InfeasibleError when the model states and the reserve alone exceed every
        GPU's usable memory: then no sequence is to blame, and the error says what is (bytes
        per GPU by part, the capacity) and the smallest settings whose states fit."""
        cap = max(self.capacity(s, 1) for s in range(self.cluster.num_gpus))
        if self.fixed_bytes() < cap:
            return
        t = self.tensor_parallel
        parts = ", ".join(f"{k} {format_bytes(v / t)}" for k, v in self.model_state_parts().items())
        mode = repr(self.optimizer_sharding)
        if self.shard_domain:
            mode += f" over shard domains of {self.shard_domain}"
        raise InfeasibleError(
            f"model states do not fit: {parts} per GPU under optimizer_sharding {mode}, "
            f"tensor_parallel {t} ({self.model.total_params / 1e9:.2f}B parameters), + "
            f"{format_bytes(self.coeffs.reserved_bytes / t)} reserved; usable capacity "
            f"{format_bytes(cap / t)} per GPU. {settings.fitting_settings(self)}",
            need_bytes=self.fixed_bytes() / t,
            capacity_bytes=cap / t,
        )

    def check_fits(self, batch: Batch) -> None:
        """Raise InfeasibleError naming what fits nowhere: the model states alone, else the
        first sequence."""
        self.check_states_fit()
        dmax = max(self.cluster.allowed_degrees)
        cap = max(self.capacity(s, dmax) for s in self.cluster.placements(dmax))
        tokens = self.batch_features(batch)[:, -2]
        bad = np.flatnonzero(self.min_recompute(tokens, dmax, cap) < 0)
        if len(bad):
            s = batch.sequences[int(bad[0])]
            t = self.tensor_parallel  # figures per unit; a GPU holds 1/t (cost/units.py)
            need = float(self.memory(s.num_tokens, dmax, self.model.num_layers)) / t
            unit = f" (units of {t} GPUs)" if t > 1 else ""
            raise InfeasibleError(
                f"sequence {s.id} (shape {s.shape}, {s.num_tokens} tokens) cannot fit: needs "
                f"{format_bytes(need)} per GPU at the largest degree {dmax}{unit} with all "
                f"{self.model.num_layers} layers recomputed, model states "
                f"{format_bytes(self.fixed_bytes() / t)} of it; capacity "
                f"{format_bytes(cap / t)}. {settings.fitting_settings(self, s.num_tokens)}",
                sequence_id=s.id,
                need_bytes=need,
                capacity_bytes=cap / t,
            )
