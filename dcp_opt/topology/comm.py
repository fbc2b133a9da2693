"""A group's communication time from the graph: all-to-all (Ulysses) and ring.

Routing. Traffic from GPU s to GPU t takes the paths with the fewest hops in the outermost
tier, then the fewest in the next tier in, ... (NCCL sends to a peer in its NVLink domain
over NVLink, and the network routes minimum-hop), split evenly at each hop over the next
hops that stay on such a path: ECMP, as InfiniBand and Ethernet fat-trees spread flows over
their spines. Routing never looks at bandwidth, so adding bandwidth to a link only shortens
times (a bandwidth-weighted route could pile every flow onto a link made faster). GPUs
forward nothing (a GPU is only a path's end): traffic between rails crosses the spine
(NCCL's PXN, which forwards through a peer GPU over NVLink, is not modelled: conservative).

All-to-all (Ulysses). Every member sends a share 1/(d-1) of its `sent` bytes to each of the
d-1 others, all at once. A link carrying `load` such shares is busy sent * load/(d-1) /
bandwidth: the congestion (cut) lower bound of an all-to-all, time >= traffic across a cut
/ the cut's capacity, taken at every link, so it covers both the per-GPU injection limit
(the GPU's own link) and the shared links' capacity (a leaf's uplinks: the bisection of an
oversubscribed tree) -- Bruck et al. 1997, "Efficient algorithms for all-to-all
communications in multiport message-passing systems", sec. 2 (the bisection bound); the
same link-load argument as NCCL's all-to-all analyses (bus bandwidth = algorithm bandwidth
* (n-1)/n, nccl-tests doc/PERFORMANCE.md). Links are grouped in tiers (NVLink, network):
within a tier the most loaded link sets the time (the links run concurrently); across tiers
the times add ("sum", the default) or overlap ("max"): Topology.a2a_combine.

Why "sum" by default: it is exactly the cost model's two-level formula (the share of peers
off the node at the NIC rate plus the rest at the NVLink rate, cost.CostModel
.comm_time_per_layer), which the profiler calibrates, so a two-level cluster built as a
graph keeps every figure; and it is the conservative rule -- a hierarchical all-to-all
(intra-node exchange, then inter-node) pays the two phases one after the other, and NCCL's
grouped send/recv shares one set of channels between NVLink and network peers. "max" is
the lower bound where the two overlap perfectly.

Latency. Each of the d-1 exchanges pays the latency of the farthest pair's path (the most
outer-tier hops, then the slowest: the sum of its links' latencies); on the two-level graph
that is the NIC's latency when the group spans nodes, else NVLink's, as today (even where a
profile measured NVLink slower than the NIC).

Ring (gradient all-reduce over the world, rank order). Every ring edge carries one chunk at
once; the most loaded link over all tiers sets the pace of the pipelined ring (Thakur et
al. 2005): tiers combine by max here, which on the two-level graph is the NIC rate across
nodes, as today.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .model import Topology

_HOP = 1000.0  # a hop in tier k weighs _HOP**k: fewer outer hops first (paths < 1000 hops)
_INF = float("inf")


@dataclass(frozen=True)
class GroupComm:
    """An all-to-all's cost at one placement: per tier (Topology.tiers order) the bottleneck
    link's share of a member's bytes (`shares`) and its bandwidth (`bandwidths`); time =
    combine_t(sent * share_t / bandwidth_t) + calls * latency_s * (d - 1)."""

    shares: tuple[float, ...]
    bandwidths: tuple[float, ...]
    latency_s: float

    @property
    def per_byte_s(self) -> float:
        return sum(s / b for s, b in zip(self.shares, self.bandwidths, strict=True))


def _routes(topo: Topology):
    """Adjacency with directed link ids, built once per topology."""
    return topo.cached("adj", lambda: _make_routes(topo))


def _make_routes(topo: Topology):
    g = topo.graph
    names = list(g.nodes)
    idx = {v: i for i, v in enumerate(names)}
    adj: list[list[tuple[int, int]]] = [[] for _ in names]
    links = []  # directed: (bandwidth, latency, tier index)
    tier = {t: k for k, t in enumerate(topo.tiers)}
    for a, b, e in g.edges(data=True):
        for u, v in ((a, b), (b, a)):
            adj[idx[u]].append((idx[v], len(links)))
            links.append((e["bandwidth"], e["latency_s"], tier[e["tier"]]))
    gpu = [False] * len(names)
    for v in topo.gpus:
        gpu[idx[v]] = True
    return adj, links, gpu, [idx[v] for v in topo.gpus]


def _toward(topo: Topology, t: int, sources=None):
    """For destination GPU rank t: (nodes by decreasing distance, next hops of each node
    [(node, directed link)], path latency to t of each node (its slowest ECMP path), the
    tiered-hop distance of each node). With `sources` (GPU ranks), the search stops once
    they are reached: every node of their shortest paths is nearer to t than they are, so
    what they need is settled (a ring's neighbour on the same node: a few nodes, not the
    whole fabric). Cached; a later call for a source the stored search did not reach
    searches again, whole."""
    memo = topo.cached("toward", dict)
    adj, links, gpu, gpu_idx = _routes(topo)
    found = memo.get(t)
    if found is not None:
        reached = sources is not None and all(found[3][gpu_idx[s]] < _INF for s in sources)
        if found[4] or reached:  # a whole search, or one that reached every source
            return found
        sources = None  # a source beyond the stored search: search whole, once
    want = None if sources is None else {gpu_idx[s] for s in sources}
    last = 0.0  # the distance of the farthest source settled
    dst = gpu_idx[t]
    dist = [float("inf")] * len(adj)
    dist[dst] = 0.0
    heap, done = [(0.0, dst)], [False] * len(adj)
    while heap:  # Dijkstra on tiered hops, backwards from t; GPUs other than t relay nothing
        du, u = heapq.heappop(heap)
        if done[u]:
            continue
        if want is not None and not want and du > last:
            break  # every source settled, and every node as near as the farthest of them
        done[u] = True
        if want is not None and u in want:
            want.discard(u)
            last = du
        if gpu[u] and u != dst:
            continue
        for v, lid in adj[u]:
            nd = du + _HOP ** links[lid][2]  # integers: ties are exact
            if nd < dist[v]:
                dist[v] = nd
                heapq.heappush(heap, (nd, v))
    order = sorted((u for u in range(len(adj)) if done[u]), key=lambda u: dist[u])
    dist = [d if done[u] else _INF for u, d in enumerate(dist)]  # settled only
    nexthops: list[list[tuple[int, int]]] = [[] for _ in adj]
    lat = [0.0] * len(adj)
    weight = [(_HOP**k, latency) for _, latency, k in links]  # per directed link
    for u in order[1:]:  # increasing distance: next hops' latencies are known
        hops, du, slowest = nexthops[u], dist[u], -1.0
        for v, lid in adj[u]:
            w, latency = weight[lid]
            if (v == dst or not gpu[v]) and dist[v] + w == du:
                hops.append((v, lid))
                x = latency + lat[v]
                if x > slowest:
                    slowest = x
        lat[u] = slowest
    memo[t] = (order[::-1], nexthops, lat, dist, sources is None)
    return memo[t]


def _loads(topo: Topology, pairs: dict[int, list[int]], early: bool = False) -> dict[int, float]:
    """Directed link id -> flows it carries: one unit per (source, destination) pair,
    `pairs` = {destination rank: [source ranks]}, split evenly over ECMP next hops."""
    _, _, _, gpu_idx = _routes(topo)
    load: dict[int, float] = {}
    for t, sources in pairs.items():
        order, nexthops, _, _, _ = _toward(topo, t, sources if early else None)
        flow = {gpu_idx[s]: 1.0 for s in sources}
        for u in order:
            f = flow.pop(u, 0.0)
            if not f or not nexthops[u]:  # t itself: the flow has arrived
                continue
            hops = nexthops[u]
            share = f / len(hops)
            for v, lid in hops:
                load[lid] = load.get(lid, 0.0) + share
                flow[v] = flow.get(v, 0.0) + share
    return load


def _bottlenecks(topo: Topology, load: dict[int, float]) -> tuple[list[float], list[float]]:
    """Per tier: (load, bandwidth) of the link with the largest load / bandwidth."""
    _, links, _, _ = _routes(topo)
    best = [(0.0, 1.0)] * len(topo.tiers)  # an idle tier: 0 / 1
    for lid, x in load.items():
        bw, _, k = links[lid]
        if x / bw > best[k][0] / best[k][1]:
            best[k] = (x, bw)
    return [b[0] for b in best], [b[1] for b in best]


def group_comm(topo: Topology, start: int, degree: int) -> GroupComm:
    """The all-to-all cost of the group of ranks start .. start+degree-1 (cached)."""
    memo = topo.cached("a2a", dict)
    key = (start, degree)
    if key in memo:
        return memo[key]
    k = len(topo.tiers)
    if degree == 1:
        memo[key] = GroupComm((0.0,) * k, (1.0,) * k, 0.0)
        return memo[key]
    members = range(start, start + degree)
    load = _loads(topo, {t: [s for s in members if s != t] for t in members})
    loads, bws = _bottlenecks(topo, load)
    peers = float(degree - 1)
    shares = [x / peers for x in loads]
    # When the tiers' bottlenecks split each member's peers between them (the two-level
    # graph: peers on the node, peers off it), the first share is written as 1 - the rest:
    # the cost model's own rounding, so two-level figures stay bit for bit.
    if len(loads) > 1 and sum(loads) == peers and loads[0] > 0:
        shares[0] = 1 - sum(x / peers for x in loads[1:])
    gpu_idx = _routes(topo)[3]
    # the farthest pair (most outer-tier hops, then the slowest path) sets the latency
    at = [gpu_idx[s] for s in members]
    far = []
    for t in members:
        _, _, lat_t, dist_t, _ = _toward(topo, t)
        pairs = zip(map(dist_t.__getitem__, at), map(lat_t.__getitem__, at), strict=True)
        far.append(max(pairs))
    lat = max(far)[1]
    memo[key] = GroupComm(tuple(shares), tuple(bws), lat)
    return memo[key]


def canonical_class(topo: Topology, start: int, degree: int) -> int:
    """The first placement class seen with the same cost as (start, degree): groups priced
    alike are one kind of group for simulate (one cost call for all of them, as before)."""
    memo = topo.cached("canon", dict)
    key = (start, degree)
    if key not in memo:
        same = topo.cached("by_comm", dict)
        memo[key] = same.setdefault((degree, group_comm(topo, start, degree)), start)
    return memo[key]


def group_ring(topo: Topology, start: int, degree: int) -> tuple[float, float]:
    """(load, bandwidth) of the most loaded link of a ring over ranks start .. start+degree-1
    in order (each member sends one chunk to the next at once; cached): a ring step of
    `chunk` bytes takes chunk * load / bandwidth. For ring context parallelism and the
    gradient all-reduce (group_ring(topo, 0, n) = ring_bottleneck)."""
    memo = topo.cached("ring", dict)
    key = (start, degree)
    if key not in memo:
        k = len(topo.tiers)
        if degree == 1:
            memo[key] = (0.0, 1.0)
            return memo[key]
        members = range(start, start + degree)
        # one source per destination, mostly on its node: searches that stop there
        load = _loads(topo, {start + (r - start + 1) % degree: [r] for r in members}, True)
        loads, bws = _bottlenecks(topo, load)
        worst = max(range(k), key=lambda i: loads[i] / bws[i])
        memo[key] = (loads[worst], bws[worst])
    return memo[key]


def ring_bottleneck(topo: Topology) -> tuple[float, float]:
    """(load, bandwidth) of the ring all-reduce's most loaded link over the world's ranks in
    order: the ring moves 2 (n-1)/n * bytes at bandwidth / load (cached)."""
    return group_ring(topo, 0, len(topo.gpus))


def default_comm(topo: Topology, degree: int, starts) -> GroupComm:
    """What a planner's per-degree table charges a group of `degree` placed at one of
    `starts` (the classes of its aligned placements): the least per-byte cost and the least
    latency over them. A lower bound of every placement (bounds stay valid); exact where one
    placement is cheapest in both, as on a symmetric fabric (all aligned placements alike)."""
    memo = topo.cached("default", dict)
    if degree not in memo:
        comms = [group_comm(topo, s, degree) for s in starts]
        best = min(comms, key=lambda g: g.per_byte_s)
        lat = min(g.latency_s for g in comms)
        memo[degree] = (
            best if best.latency_s == lat else GroupComm(best.shares, best.bandwidths, lat)
        )
    return memo[degree]


def a2a_time(cluster, sent, d, placement, calls: int):
    """The all-to-all seconds of one layer's forward, elementwise: `sent` bytes per member,
    degree `d`, `placement` the group's class (Cluster.comm_class; None = the per-degree
    default, default_comm), `calls` all-to-alls per layer. Written as the two-level formula
    (cost.CostModel.comm_time_per_layer): the same operations in the same order."""
    import numpy as np

    topo = cluster.topology
    dd = np.asarray(d)
    pp = np.full(dd.shape, -1) if placement is None else np.asarray(placement)
    dd, pp = np.broadcast_arrays(dd, pp)
    n = len(topo.gpus) + 1  # one key per (degree, class); class -1 = the default
    keys, inverse = np.unique(
        dd.astype(np.int64) * n + (pp.astype(np.int64) + 1), return_inverse=True
    )
    rows = []
    for key in keys.tolist():
        deg, cls = divmod(key, n)
        if cls > 0:
            rows.append(group_comm(topo, cls - 1, deg))
        else:  # cached by degree: the placements' classes are scanned once
            known = topo.cached("default", dict).get(deg)
            rows.append(known or default_comm(topo, deg, cluster.comm_classes(deg)))
    inverse = inverse.reshape(dd.shape)
    shares = np.array([g.shares for g in rows])[inverse]
    bws = np.array([g.bandwidths for g in rows])[inverse]
    lat = np.array([g.latency_s for g in rows])[inverse]
    bw_time = sent * shares[..., 0] / bws[..., 0]
    for t in range(1, len(topo.tiers)):
        part = sent * shares[..., t] / bws[..., t]
        bw_time = bw_time + part if topo.a2a_combine == "sum" else np.maximum(bw_time, part)
    return bw_time + calls * lat * (dd - 1)
