"""The cluster as frozen data: nodes, GPUs, memory, speed and bandwidth.

Process groups never live here (they belong to dcp_opt.runtime); a Cluster only says which
SP degrees exist and where a group of each degree may be placed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

from .errors import DcpOptError, require
from .errors import is_int as _int
from .errors import is_real as _real
from .errors import short_repr as _short
from .topology.model import Topology

GB = 1e9
GIB = 2**30
# Caps that keep every figure finite and every plan finishing (issue 29). A bigger cluster is a
# typo, and planning for it would not end (batches scale with it). Rates (FLOP/s, bytes/s) and
# speed factors are divided by: outside these bounds step times overflow or underflow float64
# (a bandwidth of 1e-300 made greedy loop for ever, a latency of 1e308 gave NaN step times).
# The bounds leave room for toy units (tests/toy.py: 1 FLOP/s, 0.25 bytes/s).
MAX_GPUS = 1 << 16
MIN_RATE, MAX_RATE = 1e-6, 1e30
MAX_LATENCY_S = 1e6
MAX_SPEED = 1e6


@dataclass(frozen=True)
class Cluster:
    """GPUs in `num_nodes` nodes of `gpus_per_node`; ranks are numbered node by node.

    Bandwidths are per GPU, in bytes/s, as one GPU sees them in an all-to-all:
    `intra_node_bw` over NVLink inside a node, `inter_node_bw` over the NIC across nodes.
    `speed_factors` / `memory_per_rank` describe mixed clusters (one entry per rank).
    `topology`: the fabric as wired (dcp_opt.topology; its GPUs in rank order). With one,
    group communication and the gradient ring come from its graph, and degrees and aligned
    placements from its domains; the two bandwidth fields then only seed profiles. Without
    one, the two-level model (intra/inter) as before.
    """

    name: str
    num_nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 2e-5
    speed_factors: tuple[float, ...] | None = None
    memory_per_rank: tuple[float, ...] | None = None
    degrees: tuple[int, ...] | None = field(default=None)
    topology: Topology | None = None

    def __post_init__(self) -> None:
        # Types first: a cluster file (CLI --cluster, a hand-edited JSON) must fail here,
        # naming the field, not with a TypeError from a comparison below.
        require(isinstance(self.name, str), "cluster.name", f"must be a string, got {self.name!r}")
        require(
            _int(self.num_nodes) and self.num_nodes >= 1,
            "cluster.num_nodes",
            f"must be an integer >= 1, got {self.num_nodes!r}",
        )
        require(
            _int(self.gpus_per_node) and self.gpus_per_node >= 1,
            "cluster.gpus_per_node",
            f"must be an integer >= 1, got {self.gpus_per_node!r}",
        )
        require(
            self.num_nodes * self.gpus_per_node <= MAX_GPUS,
            "cluster.num_nodes x gpus_per_node",
            f"{self.num_nodes * self.gpus_per_node} GPUs; at most {MAX_GPUS}",
        )
        for name in ("memory_bytes", "peak_flops", "intra_node_bw", "inter_node_bw"):
            value = getattr(self, name)
            low = 0 if name == "memory_bytes" else MIN_RATE
            require(
                _real(value) and low < value <= MAX_RATE,
                f"cluster.{name}",
                f"must be a finite number > 0 (above {low:g}, at most {MAX_RATE:g}), got "
                f"{_short(value)}",
            )
        for name in ("intra_node_latency_s", "inter_node_latency_s"):
            value = getattr(self, name)
            require(
                _real(value) and 0 <= value <= MAX_LATENCY_S,
                f"cluster.{name}",
                f"must be a finite number >= 0 (at most {MAX_LATENCY_S:g} s), got {_short(value)}",
            )
        for name in ("speed_factors", "memory_per_rank", "degrees"):
            if isinstance(getattr(self, name), list):  # hashable, as a frozen dataclass should be
                object.__setattr__(self, name, tuple(getattr(self, name)))
        n = self.num_gpus
        self._check_topology()
        for name, low, high in (
            ("speed_factors", 1 / MAX_SPEED, MAX_SPEED),
            ("memory_per_rank", 0, MAX_RATE),
        ):
            value = getattr(self, name)
            if value is not None:
                require(
                    isinstance(value, tuple)
                    and len(value) == n
                    and all(_real(v) and low < v <= high for v in value),
                    f"cluster.{name}",
                    f"must hold {n} positive numbers (one per rank, above {low:g}, at most "
                    f"{high:g}), got {_short(value)}",
                )
        if self.degrees is not None:
            require(
                isinstance(self.degrees, tuple) and all(_int(d) for d in self.degrees),
                "cluster.degrees",
                f"must be a list of integers or null, got {self.degrees!r}",
            )
            natural = set(self._natural_degrees())
            bad = [d for d in self.degrees if d not in natural]
            require(
                not bad and len(self.degrees) > 0,
                "cluster.degrees",
                f"{bad or 'empty'} not allowed; allowed: {sorted(natural)}",
            )

    def _check_topology(self) -> None:
        if isinstance(self.topology, dict):  # from JSON
            object.__setattr__(self, "topology", Topology.from_dict(self.topology))
        require(
            self.topology is None or isinstance(self.topology, Topology),
            "cluster.topology",
            f"must be a topology object or null, got {type(self.topology).__name__}",
        )
        if self.topology is not None:
            require(
                len(self.topology.gpus) == self.num_gpus,
                "cluster.topology.gpus",
                f"lists {len(self.topology.gpus)} GPUs; the cluster has num_nodes x "
                f"gpus_per_node = {self.num_gpus}",
            )

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def rank_speed(self, rank: int) -> float:
        return 1.0 if self.speed_factors is None else self.speed_factors[rank]

    def rank_memory(self, rank: int) -> float:
        return self.memory_bytes if self.memory_per_rank is None else self.memory_per_rank[rank]

    def _natural_degrees(self) -> list[int]:
        # Inside a node: powers of two that divide the node, plus the whole node. Across
        # nodes: whole nodes in powers of two, plus the whole cluster. This keeps every
        # group on one node or on whole nodes, and the pool of process groups small (~2N).
        g, n = self.gpus_per_node, self.num_gpus
        out = {d for d in _powers_of_two(g) if g % d == 0} | {g}
        out |= {g * k for k in _powers_of_two(self.num_nodes)} | {n}
        if self.topology is None:
            return sorted(out)
        # With a topology: an NVLink domain larger than a node adds its halvings (72, 36,
        # 18, 9 on NVL72), every domain its whole multiples. Groups may then span domains
        # (a 32-group over two 72-GPU racks, or over 24-GPU leaves): placements() and the
        # planners' tables (table.plan_table) price each placement on the graph.
        nvl = self.topology.nvlink_domain
        if nvl > g:
            out |= {nvl // 2**k for k in range(nvl.bit_length()) if nvl % 2**k == 0}
        for s in self.topology.domain_sizes:
            out |= {s * k for k in _powers_of_two(n // s)}
        return sorted(out)

    @cached_property
    def allowed_degrees(self) -> tuple[int, ...]:
        """SP degrees a group may have, ascending."""
        return tuple(sorted(self.degrees)) if self.degrees else tuple(self._natural_degrees())

    def placements(self, degree: int) -> tuple[int, ...]:
        """Start ranks a group of `degree` may take: what validate() accepts. Without a
        topology, start % degree == 0. With one, those too (a group may then span domains:
        9 x 32 over four 72-GPU racks, three across racks), plus the starts aligned to the
        start of the smallest domain that holds the group when the degree does not divide
        it: start = domain start + k * degree (a 32-group at 0 or 32 of every rack, 8 inside
        racks where start % 32 == 0 gives 6). Where every domain size is a multiple of the
        degree or of the domain (every power-of-two fabric, the two-level graph), the same
        as without a topology."""
        if degree not in self.allowed_degrees:
            raise DcpOptError(
                f"degree: {degree} not allowed; allowed: {list(self.allowed_degrees)}"
            )
        return self.aligned_starts(degree)

    def aligned_starts(self, degree: int) -> tuple[int, ...]:
        """placements() without the check that `degree` is allowed (validate() names a
        misaligned group's legal starts even when its degree is refused too)."""
        return self._starts(degree)[0]

    def is_placement(self, start: int, degree: int) -> bool:
        """Whether a group of an allowed `degree` may start at rank `start` (placements())."""
        return start in self._starts(degree)[1]

    def _starts(self, degree: int) -> tuple[tuple[int, ...], frozenset]:
        found = self._placement_memo.get(degree)
        if found is None:
            n = self.num_gpus
            starts = set(range(0, n - degree + 1, degree))
            if self.topology is not None:
                size = min(s for s in (*self.topology.domain_sizes, n) if s >= degree)
                if size % degree:
                    starts |= {
                        b + k * degree for b in range(0, n, size) for k in range(size // degree)
                    }
            found = self._placement_memo[degree] = (tuple(sorted(starts)), frozenset(starts))
        return found

    @cached_property
    def _placement_memo(self) -> dict:
        return {}

    def spans_nodes(self, start: int, degree: int) -> bool:
        return self.node_of(start) != self.node_of(start + degree - 1)

    def straddles(self, start: int, degree: int) -> bool:
        """A group that would fit in one node (with a topology: one domain) but sits across
        two: validate() refuses it."""
        if self.topology is None:
            return degree <= self.gpus_per_node and self.spans_nodes(start, degree)
        return any(
            degree <= s and start // s != (start + degree - 1) // s
            for s in self.topology.domain_sizes
        )

    def comm_class(self, start: int, degree: int):
        """What a group's communication time depends on besides its degree: whether it spans
        nodes (two-level model), or with a topology its start modulo the fabric's period
        (the start itself where no period is claimed). CostModel's `spans_nodes` argument."""
        if self.topology is None:
            return self.spans_nodes(start, degree)
        memo = self.topology.cached("class", dict)  # simulate asks once per group
        found = memo.get((start, degree))
        if found is None:
            from .topology.comm import canonical_class

            p = self.topology.period
            found = canonical_class(self.topology, start % p if p else start, degree)
            memo[(start, degree)] = found
        return found

    def comm_classes(self, degree: int) -> tuple[int, ...]:
        """The distinct comm_class of the aligned placements of `degree`."""
        return tuple(sorted({self.comm_class(s, degree) for s in self.placements(degree)}))

    def group_speed(self, start: int, degree: int) -> float:
        """A group runs at the pace of its slowest member."""
        if self.speed_factors is None:
            return 1.0
        return min(self.speed_factors[start : start + degree])

    def group_memory(self, start: int, degree: int) -> float:
        if self.memory_per_rank is None:
            return self.memory_bytes
        return min(self.memory_per_rank[start : start + degree])

    @property
    def total_speed(self) -> float:
        return float(self.num_gpus if self.speed_factors is None else sum(self.speed_factors))

    @property
    def homogeneous(self) -> bool:
        return self.speed_factors is None and self.memory_per_rank is None

    def to_dict(self) -> dict:
        d = self._plain_dict()
        if self.topology is not None:
            d["topology"] = self.topology.to_dict()
        return d

    def _plain_dict(self) -> dict:
        """Every field but the topology: absent, not null, so that a cluster without one
        has the fingerprint it had before topologies."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "topology"}
        for k in ("speed_factors", "memory_per_rank", "degrees"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    def fingerprint_dict(self) -> dict:
        """to_dict() with the topology as its digest (the same without one): what a cost
        fingerprint hashes, without serialising every link on every plan."""
        d = self._plain_dict()
        if self.topology is not None:
            d["topology"] = {"sha256": self.topology.digest}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Cluster:
        d = dict(d)
        for k in ("speed_factors", "memory_per_rank", "degrees"):
            if isinstance(d.get(k), list):
                d[k] = tuple(d[k])
        try:
            return cls(**d)
        except TypeError as e:
            raise DcpOptError(f"cluster: {e}") from None

    def with_(self, **changes) -> Cluster:
        d = self.to_dict()
        d["topology"] = self.topology  # the same object: its graph and caches are kept
        d.update(changes)
        n, g = d.get("num_nodes"), d.get("gpus_per_node")
        n = n * g if _int(n) and _int(g) else self.num_gpus  # bad values: __post_init__ says
        topo = d["topology"]
        if "topology" not in changes and topo is not None and n != self.num_gpus:
            require(
                isinstance(n, int) and 1 <= n <= self.num_gpus,
                "cluster.topology",
                f"a fabric of {self.num_gpus} GPUs cannot hold {n}; give a topology",
            )
            d["topology"] = topo.first(n)  # the first n GPUs' part of the fabric
        return Cluster.from_dict(d)


def _powers_of_two(limit: int) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out
