"""dcp_opt: plan and run distributed training on variable-length sequences.

The core (this package) is pure Python + numpy: no torch, no OR-Tools. Planners live in
`dcp_opt.solvers`, the torch.distributed executor in `dcp_opt.runtime`.
"""

from .batch import Batch, Sequence
from .bounds import LowerBound, lower_bound
from .build import make_plan
from .cluster import Cluster
from .cost import CostCoefficients, CostModel, Efficiency, flops_coefficients
from .errors import DcpOptError, InfeasibleError, PlanFormatError
from .model import MODEL_PRESETS, ModelSpec, model_preset
from .plan import Group, MicroBatch, Phase, Plan
from .result import PlanResult
from .simulate import SimResult, simulate
from .table import SeqTable, seq_table
from .topology.presets import CLUSTER_PRESETS, cluster_preset
from .validate import InvalidPlanError, Violation, ensure_valid, validate
from .workloads import STANDARD_WORKLOADS, Workload, load_batch, standard_batch

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Sequence",
    "LowerBound",
    "lower_bound",
    "make_plan",
    "CLUSTER_PRESETS",
    "Cluster",
    "cluster_preset",
    "CostCoefficients",
    "CostModel",
    "Efficiency",
    "flops_coefficients",
    "DcpOptError",
    "InfeasibleError",
    "PlanFormatError",
    "MODEL_PRESETS",
    "ModelSpec",
    "model_preset",
    "PlanResult",
    "Group",
    "MicroBatch",
    "Phase",
    "Plan",
    "SimResult",
    "simulate",
    "SeqTable",
    "seq_table",
    "InvalidPlanError",
    "Violation",
    "ensure_valid",
    "validate",
    "STANDARD_WORKLOADS",
    "Workload",
    "load_batch",
    "standard_batch",
]
