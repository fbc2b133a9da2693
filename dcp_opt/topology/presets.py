"""Clusters by name (`cluster_preset`: the two-level presets and h200xN) and fabrics as
built: the two-level cluster as a graph, and presets from vendor reference architectures. Bandwidths are per direction, bytes/s (the cluster module's convention).

Sources:
- GB200 NVL72: NVIDIA GB200 NVL72 data sheet (nvidia.com/en-us/data-center/gb200-nvl72):
  72 Blackwell GPUs behind one NVLink switch system, NVLink 5 1.8 TB/s per GPU
  bidirectional (900 GB/s each way), 186 GB HBM3e per GPU (13.4 TB per rack), FP16/BF16
  360 PFLOPS per rack with sparsity (2.5 PFLOPS dense per GPU). Racks join over
  InfiniBand, one 400 Gb/s (NDR) port per GPU (50 GB/s) in the DGX SuperPOD reference
  architecture for DGX GB200 (docs.nvidia.com/dgx-superpod/reference-architecture-scalable-
  infrastructure-gb200: scalable units of 8 NVL72 racks, NDR InfiniBand compute fabric),
  modelled here as one non-blocking switch.
- DGX H100 SuperPOD (NVIDIA DGX SuperPOD Reference Architecture featuring DGX H100,
  RA-11333-001, "Compute Fabric"): a scalable unit of 32 DGX H100 nodes; rail-optimized:
  GPU i of every node's ConnectX-7 (400 Gb/s) goes to rail leaf i; leaves are non-blocking
  (as many 400G uplinks to the spine as downlinks). NVLink 4 inside a node, 900 GB/s
  bidirectional per GPU (450 GB/s each way); PCIe Gen5 x16 between GPU and NIC (~64 GB/s
  each way).
- Two-tier fat-tree oversubscribed r:1: a leaf per 4 DGX H100 nodes (32 x 400G down) with
  32/r 400G uplinks spread over the spines; oversubscription = downlink / uplink capacity
  at the leaf (Al-Fares et al. 2008, "A scalable, commodity data center network
  architecture", sec. 2.1). A design point of the what-if sweep, not a vendor SKU.
  Oversubscribed leaves in GPU back-end fabrics: Juniper's validated design for an AI data
  center (juniper.net/documentation, JVD "IP Fabric GPU Backend Fabric Architecture": H100
  servers at 400GE on QFX5240 leaves; its table of ratios gives 2:1 with 8 servers and 200G
  leaf-spine links, set up to test congestion); a 1024-GPU two-tier design with 32 x 400G down and 16 x 400G up per
  leaf, 2:1 (losslessnetwork.com, "Cluster sizing and cabling"). The benchmark's leaves of 2
  or 3 DGX (whatif.fat_tree_cluster(ratio, leaves, nodes_per_leaf)) are smaller design
  points: a ToR per two or three servers.
"""

from __future__ import annotations

from functools import cache

from ..cluster import GB, MAX_GPUS, Cluster
from ..errors import DcpOptError
from .model import Link, Topology

NVLINK4 = 450 * GB  # H100/H200 NVLink 4, per GPU each way
NVLINK5 = 900 * GB  # B200 NVLink 5
NDR = 50 * GB  # 400 Gb/s ConnectX-7 port
PCIE5 = 64 * GB  # PCIe Gen5 x16, each way


def two_level(cluster: Cluster) -> Topology:
    """The cost model's two-level cluster as a graph: each node's GPUs on one NVLink switch
    at `intra_node_bw`, every GPU on one network switch at `inter_node_bw` (its NIC). Each
    link has half the path latency, so a path (two links) has the cluster's latency."""
    gpn = cluster.gpus_per_node
    gpus = tuple(f"n{i}.g{j}" for i in range(cluster.num_nodes) for j in range(gpn))
    switches = [(f"n{i}.nvs", 0) for i in range(cluster.num_nodes)]
    links = [
        Link(
            g, f"n{r // gpn}.nvs", cluster.intra_node_bw, cluster.intra_node_latency_s / 2, "nvlink"
        )
        for r, g in enumerate(gpus)
    ]
    if cluster.num_nodes > 1:
        switches.append(("net", 1))
        links += [
            Link(g, "net", cluster.inter_node_bw, cluster.inter_node_latency_s / 2) for g in gpus
        ]
    return Topology(gpus, tuple(switches), tuple(links), period=gpn, name="two-level")


def nvl72(racks: int = 1) -> Topology:
    """GB200 NVL72 racks: 72 GPUs on one NVLink switch each; several racks over IB (a NIC
    per GPU on PCIe Gen5, 400G to one non-blocking switch)."""
    gpus = tuple(f"r{k}.g{j}" for k in range(racks) for j in range(72))
    switches = [(f"r{k}.nvl", 0) for k in range(racks)]
    links = [Link(g, f"r{r // 72}.nvl", NVLINK5, 2.5e-6, "nvlink") for r, g in enumerate(gpus)]
    nics: tuple[str, ...] = ()
    if racks > 1:
        nics = tuple(f"{g}.nic" for g in gpus)
        switches.append(("ib", 1))
        links += [Link(g, f"{g}.nic", PCIE5) for g in gpus]
        links += [Link(f"{g}.nic", "ib", NDR, 1e-5) for g in gpus]
    return Topology(gpus, tuple(switches), tuple(links), nics, period=72, name=f"nvl72x{racks}")


def _dgx_nodes(nodes: int, gpus: list, switches: list, links: list, nics: list) -> None:
    """DGX H100 nodes: 8 GPUs on NVSwitch, each GPU's own NIC on PCIe."""
    for i in range(nodes):
        switches.append((f"n{i}.nvs", 0))
        for j in range(8):
            g = f"n{i}.g{j}"
            gpus.append(g)
            nics.append(f"{g}.nic")
            links.append(Link(g, f"n{i}.nvs", NVLINK4, 2.5e-6, "nvlink"))
            links.append(Link(g, f"{g}.nic", PCIE5))


def superpod(nodes: int = 32) -> Topology:
    """One rail-optimized DGX H100 scalable unit: NIC j of every node on rail leaf j; each
    leaf's uplinks (as many as its downlinks: non-blocking) to the spine, one aggregate."""
    gpus, switches, links, nics = [], [("spine", 2)], [], []
    _dgx_nodes(nodes, gpus, switches, links, nics)
    for j in range(8):
        switches.append((f"rail{j}", 1))
        links += [Link(f"n{i}.g{j}.nic", f"rail{j}", NDR, 1e-5) for i in range(nodes)]
        links.append(Link(f"rail{j}", "spine", NDR * nodes, 0.0))
    return Topology(tuple(gpus), tuple(switches), tuple(links), tuple(nics), period=8, name="rail")


def fat_tree(
    leaves: int = 4, nodes_per_leaf: int = 4, oversubscription: float = 2.0, spines: int = 2
) -> Topology:
    """A two-tier fat-tree of DGX H100 nodes: a leaf per `nodes_per_leaf` nodes, its uplink
    capacity = downlink capacity / `oversubscription`, spread evenly over `spines`."""
    if not oversubscription > 0:
        raise DcpOptError(f"oversubscription: must be > 0, got {oversubscription!r}")
    gpus, switches, links, nics = [], [], [], []
    _dgx_nodes(leaves * nodes_per_leaf, gpus, switches, links, nics)
    down = 8 * nodes_per_leaf * NDR
    for s in range(spines):
        switches.append((f"spine{s}", 2))
    for k in range(leaves):
        switches.append((f"leaf{k}", 1))
        for i in range(k * nodes_per_leaf, (k + 1) * nodes_per_leaf):
            links += [Link(f"n{i}.g{j}.nic", f"leaf{k}", NDR, 1e-5) for j in range(8)]
        up = down / oversubscription / spines
        links += [Link(f"leaf{k}", f"spine{s}", up, 0.0) for s in range(spines)]
    name = f"fat-tree {oversubscription:g}:1"
    return Topology(
        tuple(gpus),
        tuple(switches),
        tuple(links),
        tuple(nics),
        period=8 * nodes_per_leaf,
        name=name,
    )


def _h100(name: str, topo: Topology) -> Cluster:
    return Cluster(name, len(topo.gpus) // 8, 8, 80 * GB, 989e12, NVLINK4, NDR, topology=topo)


@cache
def topology_preset(name: str) -> Cluster | None:
    """A cluster preset with a topology, or None (built on first use: networkx loads then).
    GB200: one compute tray (4 GPUs) is `gpus_per_node`; the NVLink domain is the rack."""
    if name == "gb200-nvl72" or (name.startswith("gb200-nvl72x") and name[12:].isdigit()):
        racks = 1 if name == "gb200-nvl72" else int(name[12:])
        if racks < 1:
            return None
        return Cluster(
            name,
            18 * racks,
            4,
            186 * GB,
            2.5e15,
            NVLINK5,
            NDR,
            2.5e-6 * 2,
            2e-5,
            topology=nvl72(racks),
        )
    if name == "h100-superpod":
        return _h100(name, superpod(32))
    if name == "h100-superpod-4n":  # four nodes of the same wiring: small enough for tests
        return _h100(name, superpod(4))
    if name == "h100-fattree-2to1":
        return _h100(name, fat_tree(4, 4, 2.0))
    if name == "h100x64-fattree-2to1":  # 2 leaves of 4 nodes: the latency benchmark's scale
        return _h100(name, fat_tree(2, 4, 2.0))
    return None


TOPOLOGY_PRESETS = (
    "gb200-nvl72",
    "gb200-nvl72xN",
    "h100-superpod",
    "h100-superpod-4n",
    "h100-fattree-2to1",
    "h100x64-fattree-2to1",
)


# Presets. Peak = dense bf16 tensor FLOP/s from the vendor data sheets; bandwidths are per-GPU
# unidirectional: NVLink4 900 GB/s bidirectional -> ~450 GB/s one way (H100/H200); A100 NVLink3
# 600 -> 300 GB/s; one 400 Gb/s NDR NIC per GPU -> 50 GB/s (A100 nodes: 200 Gb/s -> 25 GB/s).
def _h200(nodes: int, name: str) -> Cluster:
    return Cluster(name, nodes, 8, 141 * GB, 989e12, 450 * GB, 50 * GB)


CLUSTER_PRESETS: dict[str, Cluster] = {
    "h200x8": _h200(1, "h200x8"),
    "h200x24": _h200(3, "h200x24"),
    "h200x32": _h200(4, "h200x32"),
    "h200x256": _h200(32, "h200x256"),
    "h200x1024": _h200(128, "h200x1024"),
    "h100x64": Cluster("h100x64", 8, 8, 80 * GB, 989e12, 450 * GB, 50 * GB),
    "a100x16": Cluster("a100x16", 2, 8, 80 * GB, 312e12, 300 * GB, 25 * GB),
}


def cluster_preset(name: str) -> Cluster:
    """A preset by name; `h200xN` for any N that is a multiple of 8 (or N <= 8) works too;
    fabrics with a topology (topology_preset: gb200-nvl72, h100-superpod, ...)."""
    if name in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[name]
    _check_preset_size(name)
    if name.startswith(("gb200-", "h100-", "h100x64-")):
        found = topology_preset(name)
        if found is not None:
            return found
    if name.startswith("h200x") and name[5:].isdigit():
        n = int(name[5:])
        if n >= 1 and (n <= 8 or n % 8 == 0):
            nodes, per = (1, n) if n <= 8 else (n // 8, 8)
            return Cluster(name, nodes, per, 141 * GB, 989e12, 450 * GB, 50 * GB)
    raise DcpOptError(
        f"cluster: unknown preset {name!r}; allowed: {sorted(CLUSTER_PRESETS)}, h200xN "
        "(N <= 8 or a multiple of 8), gb200-nvl72, gb200-nvl72xN (N racks), h100-superpod, "
        "h100-superpod-4n, h100-fattree-2to1, h100x64-fattree-2to1"
    )


def _check_preset_size(name: str) -> None:
    """Refuse `h200xN` and `gb200-nvl72xN` beyond MAX_GPUS before building them: a rack
    count's topology graph takes gigabytes long before the Cluster would refuse it."""
    for prefix, per in (("h200x", 1), ("gb200-nvl72x", 72)):
        count = name[len(prefix) :]
        if name.startswith(prefix) and count.isdigit() and len(count) < 20:
            if int(count) * per > MAX_GPUS:
                raise DcpOptError(
                    f"cluster: preset {name!r} has {int(count) * per} GPUs; at most {MAX_GPUS}"
                )
        elif name.startswith(prefix) and count.isdigit():
            raise DcpOptError(
                f"cluster: preset {name[:40]!r}... has a {len(count)}-digit GPU count; at most "
                f"{MAX_GPUS} GPUs"
            )
