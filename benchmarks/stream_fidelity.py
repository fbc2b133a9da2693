"""The paper's ratios against the published methods run as published on the stream benchmark,
with the cost model as it is ("before") and with each candidate effect that has a physical
source (docs/baselines.md, "Paper fidelity").

    .venv/bin/python benchmarks/stream_fidelity.py [--batches 128] [--json OUT]

For each cluster (h200x8: the README figure, per workload; h200x32: the paper's table, ranges)
and each cost-model variant, runs bucket, dcp_intra, dcp_inter and dcp_inter_pac as published
(dcp_opt.analysis.stream.run_published: cap 0.7, PAC min 15, drop_last) over one epoch of each 2D
workload and prints tokens/s over published bucket next to the paper's ratio. Variants:

- before: the preset cost model;
- caption: the caption's cross-attention k/v is computed whole on every rank of an SP group
  (VideoSys splits only the video tokens: open_sora_transformer_3d.py:598-603), so the
  per-sequence term is not divided by the degree;
- data-lo / data-hi: the dummy dataset draws a 300 x 4096 fp32 caption per sample on the CPU
  (datasets.py:436) and every rank of an SP group loads every sample of its micro-batch
  (research sec. 2.6): per-sample seconds every member repeats (CostModel.replicated_seq_s).
  Measured here (CPU time, one thread of this VM's Xeon): torch.rand(1, 300, 4096) 6.2 ms,
  collating it 3.5 ms, so 9.6 ms per sample per loader worker, over the 8 workers of
  baseline.yaml:21: 1.2 ms per sample per rank ("lo": 1 ms); "hi" (2 ms) adds the main
  process's pinned copy and the 4.9 MB host-to-device copy (~0.7 ms at 10 and 25 GB/s).
  Charged in addition to the GPU work: an upper bound where prefetching hides it;
  `--data-path-s` overrides the values (a sensitivity beyond the measured range);
- after-lo / after-hi: caption + data-lo / data-hi;
- yaml-bucket: the cost model as before, but bucket parallel with the yaml's bucket_config
  batch sizes, which the published code ignores (a different baseline, not a model change).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np

from dcp_opt.analysis.stream import MILLION, PAPER_RATIOS, run_published, stream_epoch
from dcp_opt.cost import CostModel
from dcp_opt.inputs import load_cluster
from dcp_opt.model import model_preset
from dcp_opt.perturb import perturb

WORKLOADS = ("2d-short", "2d-balanced", "2d-long", "2d-videosys")
METHODS = ("bucket", "dcp_intra", "dcp_inter", "dcp_inter_pac")
DATA_PATH_S = {"lo": 0.001, "hi": 0.002}  # seconds per sample per rank (module docstring)


@dataclass(frozen=True)
class CaptionReplicated(CostModel):
    """The per-sequence term (STDiT3's caption k/v) whole on every rank of a group."""

    def _layer_vectors(self, d: int):
        key = ("lv-caption", d)
        if key not in self._cache:
            wf, cf, wb, cb = CostModel._layer_vectors(self, d)
            nb = len(self.model.block_types)
            wf, wb = wf.copy(), wb.copy()
            per_layer = self.replicated_seq_s / self.model.num_layers  # already whole
            for w, share in ((wf, 1 / 3), (wb, 2 / 3)):  # cost.py's _PASS_SHARE
                rep = per_layer * share
                w[nb + 1] = (w[nb + 1] - rep) * d + rep  # undo the / d of the seq term
            self._cache[key] = (wf, cf, wb, cb)
        return self._cache[key]

    @property
    def takes_degree_vectors(self) -> bool:
        return False


def variants(cluster, data_path_s=DATA_PATH_S) -> dict[str, CostModel]:
    base = CostModel(model_preset("opensora-stdit3-xl"), cluster)
    cap = CaptionReplicated(base.model, cluster)
    out = {"before": base, "caption": cap}
    for tag, s in data_path_s.items():
        out[f"data-{tag}"] = perturb(base, replicated_seq_s=s)
        out[f"after-{tag}"] = cap.with_(replicated_seq_s=s)
    return out


def ratios(epoch, cost, seed, yaml_bucket=False) -> dict[str, float]:
    from dcp_opt.solvers.baselines.videosys.stream import yaml_bucket_sizes

    tps = {}
    for m in METHODS:
        kw = {"bucket_sizes": yaml_bucket_sizes()} if (m == "bucket" and yaml_bucket) else {}
        run = run_published(epoch, cost, m, seed=seed, drop_last=True, memory_cap=0.7, **kw)
        trained = sum(epoch.tokens_by_id[i] for s in run.steps for i in s)
        total = sum(run.step_times)
        tps[m] = trained / total if total else None  # None: the sampler formed no step
    base = tps["bucket"]
    out = {m: tps[m] / base if tps[m] and base else None for m in METHODS[1:]}
    return out | {"bucket_tok_s": base, "dropped_all": [m for m in METHODS if not tps[m]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clusters", default="h200x8,h200x32")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    ap.add_argument("--data-path-s", default=None, help="lo,hi seconds (default 0.001,0.002)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    data = DATA_PATH_S
    if args.data_path_s:
        data = dict(zip(("lo", "hi"), map(float, args.data_path_s.split(",")), strict=True))
    only = set(args.only.split(",")) if args.only else None
    t0 = time.perf_counter()
    rows = []
    for cname in args.clusters.split(","):
        cluster = load_cluster(cname)
        paper = PAPER_RATIOS.get(cluster.num_gpus, {})
        for w in args.workloads.split(","):
            epoch = stream_epoch(w, args.seed, args.batches, 2 * MILLION)
            for name, cost in [*variants(cluster, data).items(), ("yaml-bucket", None)]:
                if only is not None and name not in only:
                    continue
                c = cost or CostModel(model_preset("opensora-stdit3-xl"), cluster)
                r = ratios(epoch, c, args.seed, yaml_bucket=cost is None)
                ref = paper.get(w, paper.get("*", {}))
                rows.append({"cluster": cname, "workload": w, "variant": name, **r,
                             "paper": {m: ref.get(m) for m in METHODS[1:]}})  # fmt: skip
                print(
                    f"{cname} {w:12s} {name:12s} "
                    + " ".join(f"{m}={r[m] or 0:.2f}" for m in METHODS[1:])
                    + "  paper "
                    + " ".join(f"{m}={ref.get(m)}" for m in METHODS[1:] if ref.get(m)),
                    flush=True,
                )
    doc = {
        "schema": "dcp-opt-stream-fidelity/1",
        "batches": args.batches,
        "seed": args.seed,
        "data_path_s": data,
        "rows": rows,
        "wall_time_s": time.perf_counter() - t0,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                doc, f, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist") else repr(x)
            )
    print(f"{doc['wall_time_s']:.0f} s")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
