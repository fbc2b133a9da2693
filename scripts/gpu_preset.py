"""Profile real-size blocks on one CUDA GPU and write them as cost-model presets (issue 5.5).

    python3 scripts/gpu_preset.py --out-dir "$OUT"          # one H200: about 3 minutes
    python scripts/gpu_preset.py --smoke --out-dir /tmp/p    # CPU, tiny sizes, seconds

Two models, each measured one layer deep and extrapolated to its full depth:

- llama-7b: one Llama-2-7B decoder layer (hidden 4096, 32 heads, SwiGLU 11008, vocab 32000)
  through transformers' own LlamaDecoderLayer (runtime/profile/hf.py), packed sequences with
  per-sequence positions, runtime/hf.py's attention at SP degree 1 (one PyTorch SDPA call per
  sequence: the flash kernel at bf16), plus the embedding + LM head + loss; 32 layers.
- stdit3-xl: one STDiT3-XL-like layer, runtime/models.py's DiTBlock scaled to Open-Sora 1.2
  STDiT3-XL/2 (hidden 1152, 16 heads, MLP 4608, cross-attention to 300 caption tokens): a
  spatial and a temporal block; 28 layers. It omits STDiT3's elementwise extras (adaLN
  modulation, q/k RMSNorm, temporal RoPE), so it slightly underestimates their time.

Both at bf16 over a grid of lengths / video shapes, recompute off and on, timed with CUDA
events, memory by saved-tensor bytes and the allocator peak (runtime/profile/measure.py). Writes,
per model, `<prefix>_<model>.profile.json` (the preset, loadable by
dcp_opt.profile_io.cost_model_from_profile with dcp_opt's model preset of the same name;
device name and date inside) and `<prefix>_<model>.points.json` (every measured point), and
prints a summary table. `--smoke` runs the same code on the CPU at tiny sizes.

The GPU machine gets a bare copy of this repository: nothing is pip-installed there, so the
script imports dcp_opt from this checkout when the package is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import re
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_dcp_opt() -> str:
    """Make `dcp_opt` and `dcp_opt.runtime` importable; returns how. pyproject maps
    `dcp_opt.runtime` to runtime/, which a plain sys.path entry cannot express."""
    try:
        import dcp_opt.runtime  # noqa: F401

        return "installed package"
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    import dcp_opt

    spec = importlib.util.spec_from_file_location(
        "dcp_opt.runtime",
        ROOT / "runtime" / "__init__.py",
        submodule_search_locations=[str(ROOT / "runtime")],
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dcp_opt.runtime"] = mod
    dcp_opt.runtime = mod
    spec.loader.exec_module(mod)
    return f"this checkout ({ROOT}), bootstrapped"


# ---- what is measured ------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    key: str  # file name part, and dcp_opt's model preset it must match (full run)
    preset: str
    reference: tuple  # micro-batch shapes of the per-layer prediction in the summary
    smoke_reference: tuple


JOBS = {
    "llama-7b": Job("llama-7b", "llama-7b", ((4096,),), ((64,),)),
    "stdit3-xl": Job("stdit3-xl", "opensora-stdit3-xl", ((16, 30, 53),), ((4, 4, 4),)),
}


SMOKE_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=256, head_dim=16,
)  # fmt: skip


def grid(key: str, smoke: bool):
    from dcp_opt.runtime.profile.measure import Grid

    if smoke:
        return Grid(
            lengths=(16, 32, 64, 96), pack=(1, 2, 3), max_tokens=192,
            frames=(1, 2, 4), spatial=((2, 2), (4, 4)), pack_2d=(1, 2), max_tokens_2d=64,
        )  # fmt: skip
    if key == "llama-7b":  # 21 micro-batches of 256..32768 tokens, 1, 2 or 4 sequences
        return Grid(lengths=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768), max_tokens=32768)
    # Latent patches of Open-Sora 1.2 resolutions (144p..720p: 9x16..45x80), 1..30 latent
    # frames (~4 s at 24 fps is 30), one or two videos: 56 micro-batches up to 64K tokens.
    return Grid(
        frames=(1, 2, 4, 8, 16, 30),
        spatial=((9, 16), (15, 27), (22, 40), (30, 53), (45, 80)),
        pack_2d=(1, 2),
        max_tokens_2d=65536,
    )


def build(key: str, *, smoke: bool, dtype, device):
    """ProfileTarget of `key` at full size, or its tiny stand-in with `smoke`."""
    from dcp_opt.runtime.models import DiTConfig
    from dcp_opt.runtime.profile.blocks import ProfileTarget, dit_target
    from dcp_opt.runtime.profile.hf import hf_target, load_hf_config

    from dcp_opt import model_preset

    preset = model_preset(JOBS[key].preset)
    if key == "llama-7b":
        cfg = load_hf_config("llama-7b")  # built in: nothing to download on the GPU machine
        if smoke:  # the same config, narrow (depth kept: the extrapolation is exercised)
            cfg.update(SMOKE_LLAMA)
        name = f"smoke-{key}" if smoke else preset.name
        return hf_target(cfg, dtype=dtype, device=device, name=name)
    widths = (32, 4, 64) if smoke else (preset.hidden, preset.num_heads, preset.ffn_hidden)
    cfg = DiTConfig(hidden=widths[0], num_heads=widths[1], ffn_hidden=widths[2], num_layers=1)
    text_tokens = 8 if smoke else preset.text_tokens
    one = dit_target(cfg, text_tokens=text_tokens, dtype=dtype)
    spec = replace(one.model, name=f"smoke-{key}" if smoke else preset.name,
                   num_layers=preset.num_layers, num_params=preset.num_params)  # fmt: skip
    blocks = {}
    for name, block in one.blocks.items():
        block.module.to(device)
        blocks[name] = device_dit_block(block, device)
    return ProfileTarget(spec, blocks, None, signature=one.signature + "/device-inputs")


def device_dit_block(block, device):
    """runtime/profile/blocks.py's DiT adapter, with two changes for real sizes. Inputs are
    drawn on the target device: the CPU draw (~10 ns per element) of a 57600 x 1152 video
    takes longer than the block runs on a GPU, and the profiler draws inputs for every run.
    The caption is held by the block, not passed as an argument: in the model it is shared
    by every layer, so a checkpointed layer keeps only its video tokens (torch's checkpoint
    keeps its tensor arguments, and 300 x 1152 caption values per call would swamp the
    checkpoint bytes of a small video)."""
    import torch
    from dcp_opt.runtime.profile.blocks import DiTBlockAdapter

    class DeviceDiTBlock(DiTBlockAdapter):
        def make_inputs(self, shapes, *, dtype, device) -> list[tuple]:
            gen = torch.Generator(device).manual_seed(self.seed)
            self.text = self.text.to(device=device, dtype=dtype)
            out = []
            for f, hh, ww in shapes:
                rows, cols = (f, hh * ww) if self.block_type == "spatial" else (hh * ww, f)
                x = torch.randn(rows, cols, self.hidden, generator=gen, device=device, dtype=dtype)
                out.append((x.requires_grad_(True),))
            return out

        def forward(self, inputs: list[tuple]) -> list:
            return [self.module(x, self.text) for (x,) in inputs]

    text = block.text.to(device)
    return DeviceDiTBlock(block.module, block.block_type, block.hidden, text, block.seed)


# ---- running ---------------------------------------------------------------------------------
def prefix_for(device_name: str, smoke: bool) -> str:
    if smoke:
        return "smoke-cpu"
    if "H200" in device_name.upper():
        return "h200"
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"


def profile_config(smoke: bool):
    from dcp_opt.runtime.profile.measure import ProfileConfig

    if smoke:
        return ProfileConfig(warmup=0, repeats=1, passes=1, min_time_s=0.0, num_threads=1)
    # GPU timings are steady: two passes of >= 3 runs (>= 50 ms timed) after two warm-ups
    # (cuBLAS / SDPA kernel choice on the first call of a shape).
    return ProfileConfig(warmup=2, repeats=3, passes=2, min_time_s=0.05, num_threads=None)


def run_job(key: str, args, *, clock, dtype, out_dir: Path, prefix: str) -> dict:
    from dcp_opt.runtime.profile.measure import profile_model

    from dcp_opt.profile_io import layer_fingerprint, save_profile

    t0 = time.perf_counter()
    target = build(key, smoke=args.smoke, dtype=dtype, device=clock.device)
    config = replace(profile_config(args.smoke), grid=grid(key, args.smoke))
    points_path = out_dir / f"{prefix}_{key}.points.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile_model(target, config, clock=clock, dtype=dtype, cache_path=points_path,
                             progress=args.progress)  # fmt: skip
    from dcp_opt import model_preset

    matches = layer_fingerprint(prof.model) == layer_fingerprint(model_preset(JOBS[key].preset))
    peaks = _peaks(points_path)
    wall = time.perf_counter() - t0
    prof = replace(prof, method={**prof.method, "preset": _preset_info(key, args, peaks, wall)})
    path = save_profile(prof, out_dir / f"{prefix}_{key}.profile.json", force=args.force)
    return {"key": key, "profile": prof, "path": path, "peaks": peaks, "wall_s": wall,
            "warnings": [str(w.message) for w in caught], "matches_preset": matches}  # fmt: skip


def _peaks(points_path: Path) -> dict:
    """Per block and recompute setting: the largest allocator peak over forward + backward
    (CUDA only; None on CPU) and its tokens."""
    out: dict = {}
    for p in json.loads(points_path.read_text()).values():
        if p.get("peak_bytes") is None:
            continue
        k = f"{p['block']}{'+rec' if p['recompute'] else ''}"
        tokens = sum(math.prod(s) for s in p["shapes"])
        if p["peak_bytes"] > out.get(k, {}).get("peak_bytes", -1):
            out[k] = {"peak_bytes": p["peak_bytes"], "tokens": tokens}
    return out


def _preset_info(key: str, args, peaks: dict, wall_s: float) -> dict:
    import torch

    info = {
        "script": "scripts/gpu_preset.py",
        "argv": sys.argv[1:],
        "job": key,
        "smoke": args.smoke,
        "wall_s": round(wall_s, 1),
        "torch_cuda": torch.version.cuda,
        "peak_allocated_bytes": peaks,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available() and not args.smoke:
        b = torch.backends.cuda
        info["sdpa_backends_enabled"] = {
            "flash": b.flash_sdp_enabled(),
            "mem_efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(),
            "math": b.math_sdp_enabled(),
        }
    return info


# ---- summary ---------------------------------------------------------------------------------
def summary_rows(result: dict, reference) -> list[list[str]]:
    from dcp_opt.fit import block_features

    prof = result["profile"]
    co = prof.coefficients
    rows = []
    for block in prof.model.block_types:
        rep = prof.fit[block]
        q, t, s = block_features(block, reference)
        pred = 0.0
        for part in ("fwd", "bwd"):
            c = getattr(co.blocks[block], part)
            pred += c.quad * q + c.lin * t + c.seq * s + c.const
        peak = result["peaks"].get(block, {}).get("peak_bytes")
        rows.append([
            prof.model.name, block, str(rep["num_points"]),
            _pct(rep["fwd"]["median_rel_err_test"]), _pct(rep["bwd"]["median_rel_err_test"]),
            _r2(rep["fwd"]["r2_test"]), f"{co.act_bytes_per_token_layer:,.0f}",
            f"{co.ckpt_bytes_per_token_layer:,.0f}",
            "-" if peak is None else f"{peak / 2**30:.2f}",
            f"{'x'.join(map(str, reference[0]))}: {pred * 1e3:.3f}",
            f"{result['wall_s']:.0f}",
        ])  # fmt: skip
    return rows


HEADER = ["model", "block", "points", "fwd err", "bwd err", "fwd R2", "act B/tok/layer",
          "ckpt B/tok/layer", "peak GiB", "ref: fwd+bwd ms/block", "wall s"]  # fmt: skip


def print_table(rows: list[list[str]], header: list[str] = HEADER) -> None:
    """Rows under `header`, columns left-aligned (scripts/gpu_memory.py uses it too)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _r2(v) -> str:
    return "-" if v is None else f"{v:.3f}"


# ---- entry -----------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (tests)")
    p.add_argument("--out-dir", default=str(ROOT / "dcp_opt" / "presets"), help="where to write")
    p.add_argument("--models", default=",".join(JOBS), help=f"comma list of {list(JOBS)}")
    p.add_argument("--force", action="store_true", help="overwrite existing profiles")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="default: bfloat16 on CUDA, float32 with --smoke")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip a model not yet started after this many seconds (default 420)")  # fmt: skip
    p.add_argument("--progress", action="store_true", help="show the profiler's progress bar")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in JOBS]
    if bad or not args.models:
        p.error(f"--models: {bad or args.models} not allowed; allowed: {list(JOBS)}")
    return args


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    how = import_dcp_opt()
    import torch
    from dcp_opt.runtime.profile.measure import CpuClock, CudaClock

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_preset: no CUDA device; run with --smoke on a CPU", file=sys.stderr)
        return 2
    clock = CpuClock() if args.smoke else CudaClock()
    dtype = getattr(torch, args.dtype or ("float32" if args.smoke else "bfloat16"))
    name = (platform.processor() or "cpu") if args.smoke else torch.cuda.get_device_name()
    prefix = prefix_for(name, args.smoke)
    out_dir = Path(args.out_dir)
    existing = [
        str(p) for k in args.models if (p := out_dir / f"{prefix}_{k}.profile.json").exists()
    ]
    if existing and not args.force:  # checked before anything is measured
        print(f"gpu_preset: {existing} exists; pass --force to overwrite", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_preset: dcp_opt from {how}; torch {torch.__version__}; device {name!r}; "
          f"dtype {dtype}; out {out_dir}", flush=True)  # fmt: skip
    rows, status = [], 0
    for key in args.models:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"gpu_preset: {key}: skipped, past --budget-s {args.budget_s:.0f}", flush=True)
            status = 1
            continue
        res = run_job(key, args, clock=clock, dtype=dtype, out_dir=out_dir, prefix=prefix)
        job = JOBS[key]
        rows += summary_rows(res, job.smoke_reference if args.smoke else job.reference)
        print(f"gpu_preset: wrote {res['path']} ({res['wall_s']:.0f} s; "
              f"{len(res['warnings'])} fit warnings)", flush=True)  # fmt: skip
        for w in res["warnings"]:
            print(f"  warning: {w}")
        if not args.smoke and not res["matches_preset"]:
            print(f"  warning: layer shape differs from dcp_opt's {job.preset!r} preset")
    print_table(rows)
    print(f"gpu_preset: total {time.perf_counter() - t_start:.0f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
