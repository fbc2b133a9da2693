"""Clusters as they are wired: a topology graph (networkx, built lazily) and the bandwidth
any group gets from it. model: the frozen data and its checks; comm: all-to-all and ring
costs from the graph (the model and its sources); presets: the two-level cluster as a graph
and vendor fabrics. Nothing here is imported by `import dcp_opt` until a cluster has a
topology (networkx loads on first use)."""

from .comm import GroupComm, group_comm, group_ring, ring_bottleneck
from .model import Link, Topology

__all__ = ["GroupComm", "Link", "Topology", "group_comm", "group_ring", "ring_bottleneck"]
