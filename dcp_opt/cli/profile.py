"""`dcp-opt profile`: measure a model's blocks on this device, fit, write a profile JSON.

    dcp-opt profile --target tiny-lm -o tiny-lm.profile.json [--force] [--a2a-world 2]
                    [--calibrate-world 2]
    dcp-opt profile --model hf:llama-7b --dtype bfloat16 -o llama-7b.profile.json

`--model hf:<name-or-path>` profiles a Hugging Face causal LM (runtime/profile/hf.py): a
built-in config, a directory with config.json, a config.json file, or a hub id already in the
local cache; nothing is downloaded.

Full-attention video DiTs (kind "3d"): `--model <preset or model JSON>` of kind 3d (e.g.
`--model wan2.1-14b`) measures one layer of runtime.models' TinyMMDiT (text_mode joint) or
TinyWanDiT (cross) at the spec's widths and caption length; `--target tiny-mmdit|tiny-wan`
one of a tiny model of --layers/--hidden/--heads/--ffn (tiny-mmdit: --layers // 2 of them
single-stream) with --text-tokens captions (runtime/profile/blocks.py, dit3d_target).

The profile loads with `dcp_opt.profile_io.cost_model_from_profile(path, model, cluster)`.
Measured points are cached (default: `<output>.points.json`), so a re-run after a crash or
with a wider grid measures only the new points. An existing profile is never replaced
without `--force`, and that is checked before anything is measured.

Torch is imported only when the command runs (`import dcp_opt` stays torch-free).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

from ..errors import DcpOptError

TARGETS = ("tiny-lm", "tiny-dit", "tiny-mmdit", "tiny-wan")
DTYPES = ("float32", "bfloat16", "float16")


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure the model on this device and fit the cost model")
    p.add_argument("--target", default="tiny-lm", choices=TARGETS, help="model to profile")
    p.add_argument(
        "--model",
        metavar="hf:NAME_OR_PATH|MODEL",
        help="instead of --target: a Hugging Face causal LM (e.g. hf:llama-7b, hf:./my-model), "
        "or a 3d model preset or ModelSpec JSON (e.g. wan2.1-14b); its config sets depth and "
        "widths (--layers/--hidden/--heads/--ffn are ignored)",
    )
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="profile JSON to write")
    p.add_argument("--force", action="store_true", help="overwrite an existing profile")
    p.add_argument("--cache", metavar="FILE", help="point cache (default <output>.points.json)")
    p.add_argument("--no-cache", action="store_true", help="measure every point again")
    p.add_argument("--layers", type=int, default=4, help="depth of the full model (default 4)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument(
        "--text-tokens", type=int, default=8, help="caption tokens per sample (tiny-mmdit/wan)"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--quick", action="store_true", help="a small grid (tests, smoke runs)")
    p.add_argument(
        "--a2a-world", type=int, default=0, help="measure local gloo all-to-all and cp collectives"
    )
    p.add_argument(
        "--calibrate-world",
        type=int,
        default=0,
        metavar="N",
        help="tiny-lm or an HF --model on CPU: run the real executor in N local gloo ranks and "
        "store the runtime calibration (per-micro-batch and per-step overheads, in-situ "
        "all-to-all)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the fit report as JSON")
    p.set_defaults(func=cmd_profile)


def _check_output(args: argparse.Namespace) -> Path:
    out = Path(args.output)
    try:
        exists, is_dir = out.exists(), out.is_dir()
    except OSError as e:  # e.g. a name too long for the file system
        raise DcpOptError(f"output {str(out)[:80]!r}: not a usable path ({e.strerror})") from None
    if exists and not args.force:
        raise DcpOptError(f"output {str(out)!r}: exists; pass --force to overwrite")
    if is_dir:
        raise DcpOptError(f"output {str(out)!r}: is a directory")
    return out


def _hf_ref(value: str) -> str:
    from dcp_opt.runtime.profile.hf import ALLOWED_FORMS

    ref = value[3:] if value.startswith("hf:") else ""
    if not ref:
        raise DcpOptError(f"--model: {value!r} not allowed; allowed: {ALLOWED_FORMS}")
    return ref


def _is_hf(args: argparse.Namespace) -> bool:
    return args.model is not None and args.model.startswith("hf:")


def _dit3d(spec, dtype):
    """Profile target of a 3d ModelSpec; the tiny blocks' width rules as a user error."""
    from dcp_opt.runtime.profile.blocks import dit3d_target

    try:
        return dit3d_target(spec, dtype=dtype)
    except ValueError as e:
        raise DcpOptError(f"model {spec.name!r}: {e}") from None


def _tiny_3d_spec(args: argparse.Namespace):
    from dcp_opt.model import ModelSpec

    if args.text_tokens < 1:
        raise DcpOptError(f"--text-tokens: must be >= 1, got {args.text_tokens}")
    joint = args.target == "tiny-mmdit"
    return ModelSpec(
        args.target,
        "3d",
        args.layers,
        args.hidden,
        args.heads,
        args.ffn,
        text_tokens=args.text_tokens,
        causal=False,
        text_mode="joint" if joint else "cross",
        single_layers=args.layers // 2 if joint else 0,
    )


def _target(args: argparse.Namespace, device: str):
    import torch

    if args.model is not None and not _is_hf(args):
        from dcp_opt.inputs import load_model
        from dcp_opt.runtime.profile.hf import ALLOWED_FORMS

        spec = load_model(args.model)
        if spec.kind != "3d":
            raise DcpOptError(
                f"--model: {args.model!r} is a {spec.kind} model; allowed: a 3d model preset "
                f"or JSON, or {ALLOWED_FORMS}"
            )
        return _dit3d(spec, getattr(torch, args.dtype)), getattr(torch, args.dtype)
    if args.model is not None:
        from dcp_opt.runtime.profile.hf import hf_target

        dtype = getattr(torch, args.dtype)
        ref = _hf_ref(args.model)
        return hf_target(ref, dtype=dtype, device=device), dtype
    from dcp_opt.runtime.models import DiTConfig, LMConfig
    from dcp_opt.runtime.profile.blocks import dit_target, lm_target

    for field in ("layers", "hidden", "heads", "ffn"):
        if getattr(args, field) < 1:
            raise DcpOptError(f"--{field}: must be >= 1, got {getattr(args, field)}")
    if args.hidden % args.heads:
        raise DcpOptError(f"--heads: must divide --hidden={args.hidden}, got {args.heads}")
    dtype = getattr(torch, args.dtype)
    common = dict(hidden=args.hidden, num_heads=args.heads, num_layers=args.layers)
    if args.target == "tiny-lm":
        cfg = LMConfig(vocab_size=512, ffn_hidden=args.ffn, **common)
        return lm_target(cfg, dtype=dtype), dtype
    if args.target in ("tiny-mmdit", "tiny-wan"):
        return _dit3d(_tiny_3d_spec(args), dtype), dtype
    cfg = DiTConfig(ffn_hidden=args.ffn, **common)
    return dit_target(cfg, dtype=dtype), dtype


def _config(args: argparse.Namespace):
    from dcp_opt.runtime.profile.measure import Grid, ProfileConfig

    if args.threads < 1:
        raise DcpOptError(f"--threads: must be >= 1, got {args.threads}")
    grid = Grid()
    if args.quick:
        grid = Grid(
            lengths=(32, 64, 128, 256),
            pack=(1, 2, 4),
            max_tokens=512,
            frames=(1, 2, 4),
            spatial=((2, 2), (4, 4)),
        )
    return ProfileConfig(grid=grid, num_threads=args.threads, passes=1 if args.quick else 2)


# The calibration builds the whole model in every local rank (fp32 weights, gradients):
# above this many parameters it would not fit a CPU host (4 GB of weights a rank).
MAX_CALIBRATION_PARAMS = 1e9


def _check_calibration(args: argparse.Namespace, device: str) -> None:
    """Refused before anything is measured: the calibration runs the runtime's executor on
    the whole model (TinyLM, or the HF model of --model) in local gloo ranks."""
    n = args.calibrate_world
    if n == 0:
        return
    if n < 2:
        raise DcpOptError(f"--calibrate-world: {n} not allowed; allowed: 0 (off) or >= 2 ranks")
    if device != "cpu" or not (_is_hf(args) or (args.model is None and args.target == "tiny-lm")):
        raise DcpOptError(
            "--calibrate-world: supported for --target tiny-lm or an HF --model on --device cpu "
            "(it runs the runtime's executor on gloo); other models: see docs/profiler.md, "
            "'runtime calibration'"
        )
    if _is_hf(args):
        from dcp_opt.runtime.profile.hf import hf_spec, load_hf_config

        spec = hf_spec(load_hf_config(_hf_ref(args.model)), name="calibration", dtype_bytes=4)
        if spec.total_params > MAX_CALIBRATION_PARAMS:
            raise DcpOptError(
                f"--calibrate-world: the model has {spec.total_params / 1e9:.2f}B parameters; "
                f"the calibration builds all of it on each of {n} local ranks: at most "
                f"{MAX_CALIBRATION_PARAMS / 1e9:.0f}B (profile a config with fewer layers)"
            )


def _calibrate(args: argparse.Namespace, prof):
    from dcp_opt.runtime.profile.fidelity import calibrate_hf, calibrate_tiny_lm

    if args.model is not None:
        return calibrate_hf(prof, _hf_ref(args.model), args.calibrate_world)

    cfg = dict(
        vocab_size=512,
        hidden=args.hidden,
        num_heads=args.heads,
        num_layers=args.layers,
        ffn_hidden=args.ffn,
    )
    return calibrate_tiny_lm(prof, cfg, args.calibrate_world)


def cmd_profile(args: argparse.Namespace) -> int:
    out = _check_output(args)
    import torch

    from dcp_opt.profile_io import save_profile
    from dcp_opt.runtime.profile.measure import CpuClock, CudaClock, profile_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise DcpOptError(f"--device: {device!r} not available; allowed: cpu, cuda (with a GPU)")
    _check_calibration(args, device)
    target, dtype = _target(args, device)
    clock = CudaClock() if device == "cuda" else CpuClock()
    if device == "cuda":
        for m in [*target.blocks.values(), target.head]:
            if m is not None:
                m.module.to("cuda")
    cache = None if args.no_cache else (args.cache or str(out) + ".points.json")
    a2a = cp = ring = ()
    if args.a2a_world:  # all-to-all, cp's all-gather / reduce-scatter, the ring's P2P step
        from dcp_opt.runtime.profile.fit import measure_comm_local

        a2a, cp, ring = measure_comm_local(args.a2a_world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile_model(
            target,
            _config(args),
            clock=clock,
            dtype=dtype,
            cache_path=cache,
            progress=not args.no_progress,
            a2a=a2a,
        )
    prof = dataclasses.replace(prof, cp=cp, ring=ring)
    if args.calibrate_world:
        prof = _calibrate(args, prof)
    save_profile(prof, out, force=args.force)
    _report(prof, out, [str(w.message) for w in caught], as_json=args.json)
    return 0


def _calibration_summary(prof) -> dict | None:
    """What the runtime calibration measured, for the report (None without one)."""
    cal = prof.runtime
    if cal is None:
        return None
    return {
        "world": cal.world,
        "compute_factor": cal.compute_factor,
        "microbatch_overhead_s": cal.microbatch_overhead_s,
        "a2a_bandwidth_bytes_per_s": cal.a2a_bandwidth_bytes_per_s,
        "a2a_latency_s": cal.a2a_latency_s,
        "grad_sync_s": cal.grad_sync_s,
        "sp_compute_overhead": {str(d): x for d, x in cal.sp_compute_overhead},
        "replicated_seq_s_per_layer": cal.replicated_seq_s_per_layer,
        "step_overhead_s": cal.step_overhead_s,
    }


def _report(prof, out: Path, warns: list[str], *, as_json: bool) -> None:
    summary = _calibration_summary(prof)
    if as_json:
        doc = {"output": str(out), "fit": prof.fit, "warnings": warns}
        print(json.dumps(doc | ({} if summary is None else {"runtime": summary}), indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fit of {prof.model.name} on {prof.device['type']} ({out})")
    for col in ("block", "part", "points (train/test)", "median rel. err", "max rel. err", "R^2"):
        table.add_column(col)
    for block, rep in prof.fit.items():
        for part in ("fwd", "bwd"):
            r = rep.get(part)
            if not r:
                continue
            table.add_row(
                block,
                part,
                f"{r['n_train']}/{r['n_test']}",
                _pct(r["median_rel_err_test"]),
                _pct(r["max_rel_err_test"]),
                "-" if r["r2_test"] is None else f"{r['r2_test']:.3f}",
            )
    console = Console()
    console.print(table)
    if summary is not None:
        over = ", ".join(f"d={d}: +{x:.0%}" for d, x in summary["sp_compute_overhead"].items())
        console.print(
            f"runtime calibration (world {summary['world']}): compute x"
            f"{summary['compute_factor']:.2f}, +{summary['microbatch_overhead_s'] * 1e3:.1f} ms "
            f"per micro-batch; SP overhead {over or 'none'}; replicated "
            f"{summary['replicated_seq_s_per_layer'] * 1e6:.1f} us per sample per layer; step "
            f"{summary['grad_sync_s'] * 1e3:.1f} ms ({summary['step_overhead_s'] * 1e3:.1f} ms "
            "fixed)"
        )
    for w in warns:
        console.print(f"[yellow]warning:[/yellow] {w}")


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"
