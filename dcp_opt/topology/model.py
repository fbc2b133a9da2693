"""A cluster's wiring as frozen data: GPUs, NICs and switches as nodes, links as edges.

The data is tuples (hashable, JSON-serialisable, part of the cost fingerprint); the
networkx graph is built on first use and cached. GPUs are listed in rank order.

Switch levels name the fabric's tiers from the inside out: 0 = an NVLink switch (an HGX
baseboard's NVSwitches, a GB200 NVL72 rack's NVLink switch trays), 1 = a leaf (top-of-rack
or rail) switch, 2 = a spine, ... Domains follow: the level-k domains are the GPUs that
reach each other without a switch of level >= k (k = 1: NVLink domains; k = 2: leaves, or
a rail-optimized scalable unit, whose rail leaves all nodes share). Placement aligns groups
to them (dcp_opt.cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..errors import DcpOptError, require
from ..errors import is_int as _int
from ..errors import is_real as _real

NODE_KINDS = ("gpu", "nic", "switch")
COMBINE_RULES = ("sum", "max")


@dataclass(frozen=True)
class Link:
    """A full-duplex link: `bandwidth` bytes/s each way, `latency_s` one way, `tier` the
    class of link whose bottlenecks combine (Topology.a2a_combine)."""

    a: str
    b: str
    bandwidth: float
    latency_s: float = 0.0
    tier: str = "network"


@dataclass(frozen=True)
class Topology:
    """GPUs (rank order), NICs, switches ((name, level)) and links between them.

    `tiers`: link classes, innermost first. `a2a_combine`: how an all-to-all's per-tier
    bottleneck times combine, "sum" (the tiers' transfers do not overlap: today's two-level
    formula) or "max" (they overlap perfectly). `period`: ranks r and r + period have the
    same surroundings (a symmetric fabric: every rack, leaf or unit wired alike), so a
    group's communication depends on its start only modulo the period; None = no symmetry
    claimed (each placement is priced on its own).
    """

    gpus: tuple[str, ...]
    switches: tuple[tuple[str, int], ...]
    links: tuple[Link, ...]
    nics: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ("nvlink", "network")
    a2a_combine: str = "sum"
    period: int | None = None
    name: str = ""
    _memo: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def cached(self, name: str, make):
        """make()'s value under `name`, kept with this topology (its routes and per-group
        costs: pure functions of the frozen fabric, computed once)."""
        found = self._memo.get(name)
        if found is None:
            found = self._memo[name] = make()
        return found

    def __post_init__(self) -> None:
        for k in ("gpus", "nics", "tiers"):
            object.__setattr__(self, k, tuple(getattr(self, k)))
        object.__setattr__(self, "switches", tuple((s[0], s[1]) for s in self.switches))
        object.__setattr__(self, "links", tuple(_link(x, i) for i, x in enumerate(self.links)))
        self._check_names()
        self._check_links()
        require(
            self.a2a_combine in COMBINE_RULES,
            "topology.a2a_combine",
            f"{self.a2a_combine!r} not allowed; allowed: {list(COMBINE_RULES)}",
        )
        require(
            self.period is None
            or (_int(self.period) and self.period >= 1 and len(self.gpus) % self.period == 0),
            "topology.period",
            f"must be null or an integer >= 1 dividing {len(self.gpus)}, got {self.period!r}",
        )
        self._check_connected()
        _ = self.domain_sizes  # refuses domains that are not equal blocks of ranks

    # ---- checks ----------------------------------------------------------------------
    def _check_names(self) -> None:
        require(len(self.gpus) >= 1, "topology.gpus", "must list at least one GPU")
        names = [*self.gpus, *self.nics, *(s for s, _ in self.switches)]
        for n in names:
            require(isinstance(n, str) and n, "topology", f"node names must be strings: {n!r}")
        dup = sorted({n for n in names if names.count(n) > 1})
        require(not dup, "topology", f"node names must be unique; repeated: {dup[:8]}")
        for s, level in self.switches:
            require(
                _int(level) and level >= 0,
                "topology.switches",
                f"level of {s!r} must be an integer >= 0, got {level!r}",
            )
        require(len(self.tiers) >= 1, "topology.tiers", "must name at least one tier")

    def _check_links(self) -> None:
        known = set(self.gpus) | set(self.nics) | {s for s, _ in self.switches}
        linked = set()
        for i, x in enumerate(self.links):
            where = f"topology.links[{i}]"
            for end in (x.a, x.b):
                require(end in known, where, f"unknown node {end!r}")
            require(x.a != x.b, where, f"a link from {x.a!r} to itself")
            require(
                _real(x.bandwidth) and x.bandwidth > 0,
                f"{where}.bandwidth",
                f"must be a finite number > 0 (bytes/s), got {x.bandwidth!r}",
            )
            require(
                _real(x.latency_s) and x.latency_s >= 0,
                f"{where}.latency_s",
                f"must be a finite number >= 0, got {x.latency_s!r}",
            )
            require(
                x.tier in self.tiers,
                f"{where}.tier",
                f"{x.tier!r} not allowed; allowed: {list(self.tiers)}",
            )
            linked |= {x.a, x.b}
        lonely = [g for g in self.gpus if g not in linked]
        if lonely:
            raise DcpOptError(f"topology.gpus: GPU {lonely[0]!r} has no links")

    def _check_connected(self) -> None:
        import networkx as nx

        parts = sorted(nx.connected_components(self.graph), key=len, reverse=True)
        if len(parts) > 1:
            first = next(g for g in self.gpus if g not in parts[0])
            raise DcpOptError(
                f"topology: the graph is disconnected ({len(parts)} parts): no path from "
                f"{self.gpus[0] if self.gpus[0] in parts[0] else first!r} to "
                f"{first if self.gpus[0] in parts[0] else self.gpus[0]!r}"
            )

    # ---- the graph ---------------------------------------------------------------------
    @cached_property
    def graph(self):
        """networkx.Graph: node attribute `kind` (gpu/nic/switch), `level` on switches;
        edge attributes `bandwidth`, `latency_s`, `tier`, `index` (into `links`). Two links
        between the same nodes are one edge of the summed bandwidth."""
        import networkx as nx

        g = nx.Graph()
        g.add_nodes_from(self.gpus, kind="gpu")
        g.add_nodes_from(self.nics, kind="nic")
        for s, level in self.switches:
            g.add_node(s, kind="switch", level=level)
        for i, x in enumerate(self.links):
            if g.has_edge(x.a, x.b):  # parallel cables: one edge of their total bandwidth
                g.edges[x.a, x.b]["bandwidth"] += x.bandwidth
                continue
            g.add_edge(x.a, x.b, bandwidth=x.bandwidth, latency_s=x.latency_s, tier=x.tier, index=i)
        return g

    @cached_property
    def domain_sizes(self) -> tuple[int, ...]:
        """Sizes of the fabric's domains, innermost first (1 and the whole cluster left out):
        for each switch level k, the GPUs that reach each other without switches of level
        >= k. Each level's domains must be equal blocks of consecutive ranks."""
        import networkx as nx

        n = len(self.gpus)
        rank = {gpu: r for r, gpu in enumerate(self.gpus)}
        levels = sorted({lv for _, lv in self.switches})
        sizes: list[int] = []
        for k in [*levels[1:], max(levels, default=0) + 1] if levels else [1]:
            cut = [s for s, lv in self.switches if lv >= k]
            keep = self.graph.subgraph(set(self.graph) - set(cut))
            blocks = sorted(
                sorted(rank[v] for v in part if v in rank) for part in nx.connected_components(keep)
            )
            blocks = [b for b in blocks if b]
            size = len(blocks[0])
            require(
                all(len(b) == size and b == list(range(b[0], b[0] + size)) for b in blocks),
                "topology",
                f"the GPUs that reach each other below switch level {k} must form equal "
                f"blocks of consecutive ranks (list the GPUs in rank order); got blocks of "
                f"sizes {sorted({len(b) for b in blocks})}",
            )
            if 1 < size < n and size not in sizes:
                sizes.append(size)
        return tuple(sizes)

    @cached_property
    def nvlink_domain(self) -> int:
        """GPUs that reach each other below the first leaf: the NVLink domain's size."""
        import networkx as nx

        keep = self.graph.subgraph(
            set(self.graph) - {s for s, lv in self.switches if lv >= 1} - set(self.nics)
        )
        return max(
            len([v for v in p if v in set(self.gpus)]) for p in nx.connected_components(keep)
        )

    def domain_starts(self) -> tuple[tuple[int, int], ...]:
        """(boundary rank, level index) of every domain boundary inside the cluster, for the
        Gantt chart's lines (level 0 = the innermost domains)."""
        out: dict[int, int] = {}
        for i, size in enumerate(self.domain_sizes):
            for r in range(size, len(self.gpus), size):
                out[r] = i
        return tuple(sorted(out.items()))

    def first(self, n: int) -> Topology:
        """The fabric of the first n GPUs: them, and the NICs and switches still on a path
        between them (a planner's block of a larger cluster)."""
        import networkx as nx

        require(1 <= n <= len(self.gpus), "topology", f"has {len(self.gpus)} GPUs, not {n}")
        if n == len(self.gpus):
            return self
        drop = set(self.gpus[n:])
        keep = nx.node_connected_component(
            self.graph.subgraph(set(self.graph) - drop), self.gpus[0]
        )
        p = self.period if self.period and n % self.period == 0 else None
        return Topology(
            self.gpus[:n],
            tuple(s for s in self.switches if s[0] in keep),
            tuple(x for x in self.links if x.a in keep and x.b in keep),
            tuple(x for x in self.nics if x in keep),
            self.tiers,
            self.a2a_combine,
            p,
            self.name,
        )

    def scaled(self, factor: float, tier: str = "network") -> Topology:
        """The same fabric with every link of `tier` `factor` times as fast (what-if)."""
        require(tier in self.tiers, "tier", f"{tier!r} not allowed; allowed: {list(self.tiers)}")
        links = tuple(
            Link(x.a, x.b, x.bandwidth * factor, x.latency_s, x.tier) if x.tier == tier else x
            for x in self.links
        )
        return Topology(
            self.gpus,
            self.switches,
            links,
            self.nics,
            self.tiers,
            self.a2a_combine,
            self.period,
            self.name,
        )

    @cached_property
    def digest(self) -> str:
        """sha256 of the JSON document: what a cost fingerprint holds for the topology."""
        import hashlib
        import json

        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    # ---- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "gpus": list(self.gpus),
            "nics": list(self.nics),
            "switches": [{"name": s, "level": lv} for s, lv in self.switches],
            "links": [
                {
                    "a": x.a,
                    "b": x.b,
                    "bandwidth": x.bandwidth,
                    "latency_s": x.latency_s,
                    "tier": x.tier,
                }
                for x in self.links
            ],
            "tiers": list(self.tiers),
            "a2a_combine": self.a2a_combine,
            "period": self.period,
        }
        if self.name:
            d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, d) -> Topology:
        require(isinstance(d, dict), "topology", f"must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        allowed = {"gpus", "nics", "switches", "links", "tiers", "a2a_combine", "period", "name"}
        extra = sorted(set(d) - allowed)
        require(not extra, "topology", f"unknown fields {extra}; allowed: {sorted(allowed)}")
        for k in ("gpus", "switches", "links"):
            require(k in d, f"topology.{k}", "missing")
        for k in ("gpus", "nics", "switches", "links", "tiers"):
            require(
                isinstance(d.get(k, []), list), f"topology.{k}", f"must be a list, got {d.get(k)!r}"
            )
        switches = []
        for i, s in enumerate(d["switches"]):
            require(
                isinstance(s, dict) and set(s) == {"name", "level"},
                f"topology.switches[{i}]",
                f'must be {{"name": ..., "level": ...}}, got {s!r}',
            )
            switches.append((s["name"], s["level"]))
        d["switches"] = tuple(switches)
        d["links"] = tuple(_link(x, i) for i, x in enumerate(d["links"]))
        return cls(**d)


def _link(x, i: int) -> Link:
    if isinstance(x, Link):
        return x
    where = f"topology.links[{i}]"
    fields = {"a", "b", "bandwidth", "latency_s", "tier"}
    require(
        isinstance(x, dict) and {"a", "b", "bandwidth"} <= set(x) <= fields,
        where,
        f"must be an object with a, b, bandwidth (and latency_s, tier), got {x!r}",
    )
    return Link(**x)
