"""The published video DiTs on the meta device (no weights, nothing downloaded): each
ModelSpec preset's num_params against sum(p.numel()) of the diffusers model built from the same
config (dcp_opt/dit_spec.py PUBLISHED). Exit 1 if any differs.

    .venv/bin/python scripts/check_dit_params.py
"""

from __future__ import annotations

import sys

import diffusers
import torch

from dcp_opt.dit_spec import PUBLISHED
from dcp_opt.model import MODEL_PRESETS


def main() -> int:
    bad = 0
    for name, (cls_name, _, cfg) in PUBLISHED.items():
        with torch.device("meta"):
            model = getattr(diffusers, cls_name)(**cfg)
        built = sum(p.numel() for p in model.parameters())
        preset = int(MODEL_PRESETS[name].num_params)
        ok = built == preset
        bad += not ok
        print(f"{name:18} {cls_name:32} diffusers {built:>14,}  preset {preset:>14,}  "
              f"{'equal' if ok else 'DIFFERENT'}")  # fmt: skip
    print(f"diffusers {diffusers.__version__}: {len(PUBLISHED) - bad}/{len(PUBLISHED)} equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
