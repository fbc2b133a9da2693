"""A toy cost model whose arithmetic fits in a comment (used by hand-built tests).

Cluster: 1 node x 4 GPUs, 100 bytes each, no communication cost, no per-step cost (no
gradient sync bytes, no closing micro-step).
Model: 2 layers, 1 parameter -> model states 1 * (2 + 4 + 12/4) = 9 bytes (zero1 over 4).
Time  (seconds) of T tokens at degree d with r recomputed layers:
    per layer fwd = T/d, bwd = 2T/d  -> 2 layers: 6T/d; + overhead 0.5; + recompute r*T/d
Memory (bytes) per member: 9 + T/d * ((2-r)*10 + r*2 + 10) = 9 + T/d * (30 - 8r)
"""

from dcp_opt import Cluster, CostCoefficients, CostModel, ModelSpec
from dcp_opt.cost import BlockCoeffs, TermCoeffs


def toy_cost(
    num_nodes: int = 1, gpus_per_node: int = 4, memory: float = 100.0, **cluster_kw
) -> CostModel:
    cluster = Cluster(
        "toy",
        num_nodes,
        gpus_per_node,
        memory,
        1.0,
        1.0,
        1.0,
        intra_node_latency_s=0.0,
        inter_node_latency_s=0.0,
        **cluster_kw,
    )
    model = ModelSpec("toy", "1d", 2, 4, 2, 8, num_params=1.0)
    coeffs = CostCoefficients(
        blocks={"layer": BlockCoeffs(TermCoeffs(lin=1.0), TermCoeffs(lin=2.0))},
        head_fwd_per_token_s=0.0,
        head_bwd_per_token_s=0.0,
        microbatch_overhead_s=0.5,
        a2a_bytes_per_token_layer=0.0,
        a2a_calls_per_layer=0,
        act_bytes_per_token_layer=10.0,
        ckpt_bytes_per_token_layer=2.0,
        head_bytes_per_token=0.0,
        reserved_bytes=0.0,
        source="toy",
    )
    return CostModel(
        model,
        cluster,
        coeffs,
        usable_memory_fraction=1.0,
        grad_reduce_bytes_per_param=0.0,
        closing_step_s=0.0,
    )
