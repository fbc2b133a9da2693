"""Peak memory and time per packed micro-batch of a bf16 Llama-7B-shaped layer stack under
the runtime's attention, next to the cost model (issue 14 item 6).

    python3 scripts/gpu_memory.py --json "$OUT/gpu_memory.json"          # one GPU, ~1-2 min
    python scripts/gpu_memory.py --device cpu --tiny --json /tmp/m.json   # CPU, tiny, seconds

The stack: transformers' LlamaForCausalLM with Llama-2-7B's widths (hidden 4096, 32 heads,
SwiGLU 11008, vocab 32000; runtime/profile/hf.py BUILTIN_CONFIGS) and `--layers` decoder
layers (default 8), random weights in bf16, made to run through runtime/hf.py
(parallelize_hf at SP degree 1): every micro-batch is one packed row with per-sequence
positions and its attention is one runtime/attention.py packed call per layer, which on CUDA
in bf16 is FlashAttention's varlen kernel (choose_kernel). The script counts the kernel calls
of each kind, so a run says whether varlen really ran.

Per micro-batch shape (`--shapes`, e.g. 4096, 2048x4 = four sequences of 2048, 1000+3096):
one warm-up (allocates the gradients, picks kernels), then the median of `--repeats`
forward + backward passes (HFCausalLMTask.run: loss, backward; no optimizer step), timed
with CUDA events (runtime/profile/clocks.py CudaClock; CPU: wall clock); then one run that
records the bytes autograd saves (SavedBytes, parameters excluded) and the allocator's peak
over forward + backward above the baseline (torch.cuda.max_memory_allocated; the baseline
holds the weights and gradients). Beside them, the cost model for llama-7b on one H200
(dcp_opt CostModel, preset coefficients), scaled to the layers run:
- time: layers x one layer's forward + backward + the head's per-token time + the
  per-micro-batch overhead (CostModel.time_parts_from at degree 1, L -> layers);
- saved: tokens x (layers x act_bytes_per_token_layer + head_bytes_per_token);
- peak: saved + one layer's act bytes per token (the layer working in backward, as
  CostModel.memory charges).
`--tiny` runs the same code on a narrow model (gpu_preset.py's smoke widths) and compares it
with the cost model of that model's own ModelSpec on the same H200 cluster: the time column
is then not comparable, the memory columns are. Prints a table; `--json` writes every
figure. The GPU machine gets a bare copy of the repository: dcp_opt is imported from this
checkout when not installed (gpu_preset.import_dcp_opt).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_preset import SMOKE_LLAMA, import_dcp_opt, print_table  # noqa: E402

SHAPES = ("4096", "16384", "2048x4", "1024x16", "8192x2")
TINY_SHAPES = ("64", "16x3", "40+24")
CLUSTER = "h200x1"


def parse_shape(text: str) -> list[int]:
    """'4096' -> [4096]; '2048x4' -> four of 2048; '1000+3096' -> [1000, 3096]."""
    out: list[int] = []
    try:
        for part in text.split("+"):
            length, _, count = part.partition("x")
            out += [int(length)] * int(count or 1)
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(
            f"--shapes: {text!r} not allowed; allowed: LENGTH, LENGTHxCOUNT or L1+L2+... "
            "(integers >= 1)"
        )
    return out


@dataclass
class Row:
    shape: str
    sequences: int
    tokens: int
    time_s: float
    pred_time_s: float
    saved_bytes: float
    pred_saved_bytes: float
    peak_bytes: float | None
    pred_peak_bytes: float
    varlen_calls: int
    reference_calls: int


# ---- the model --------------------------------------------------------------------------------
def build(args, dtype):
    """(model, ModelSpec of the full-depth model the cost model prices)."""
    import torch
    from dcp_opt.runtime import SPState
    from dcp_opt.runtime.hf import model_spec, parallelize_hf
    from dcp_opt.runtime.profile.hf import load_hf_config
    from transformers import LlamaForCausalLM

    from dcp_opt import model_preset

    cfg = load_hf_config("llama-7b")  # built in: nothing to download on the GPU machine
    if args.tiny:
        cfg.update(SMOKE_LLAMA)
    full_depth = cfg.num_hidden_layers
    cfg.num_hidden_layers = args.layers
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(dtype)
    state = SPState()
    parallelize_hf(model, state)
    if args.tiny:
        spec = model_spec(model, name="tiny-llama")
        from dataclasses import replace

        spec = replace(spec, num_layers=full_depth)
    else:
        spec = model_preset("llama-7b")
    return model, state, spec


class KernelCalls:
    """Counts runtime/attention.py's kernel calls by kind while active."""

    def __init__(self):
        from dcp_opt.runtime import attention

        self.mod, self.counts = attention, {"varlen": 0, "reference": 0}
        self.names = {"varlen": "varlen_attention", "reference": "_reference_attention"}
        self.saved = {k: getattr(attention, self.names[k]) for k in self.counts}

    def __enter__(self):
        for kind, fn in self.saved.items():
            setattr(self.mod, self.names[kind], self._counted(kind, fn))
        return self

    def _counted(self, kind, fn):
        def call(*a, **kw):
            self.counts[kind] += 1
            return fn(*a, **kw)

        return call

    def __exit__(self, *exc):
        for kind, fn in self.saved.items():
            setattr(self.mod, self.names[kind], fn)


# ---- measuring ---------------------------------------------------------------------------------
def measure(model, state, lengths: list[int], clock, repeats: int) -> dict:
    import torch
    from dcp_opt.runtime.hf import HFCausalLMTask
    from dcp_opt.runtime.profile.clocks import SavedBytes

    gen = torch.Generator().manual_seed(len(lengths))
    vocab = model.config.vocab_size
    samples = [(i, torch.randint(0, vocab, (n + 1,), generator=gen)) for i, n in enumerate(lengths)]
    task, scale = HFCausalLMTask(), 1.0 / sum(lengths)

    def run():
        task.run(model, samples, state, step=0, kind="tokens", scale=scale)

    run()  # warm-up: gradients allocated, kernels chosen
    times = []
    for _ in range(repeats):
        a = clock.mark()
        run()
        times.append(clock.seconds(a, clock.mark()))
    params = list(model.parameters())
    with KernelCalls() as calls, clock.memory_run() as box, SavedBytes(exclude=params) as saved:
        run()
    return {
        "time_s": statistics.median(times),
        "saved_bytes": float(saved.total),
        "peak_bytes": box["peak"] if box is not None else None,
        "calls": dict(calls.counts),
    }


def predict(spec, lengths: list[int], layers: int) -> dict:
    """The cost model's figures for one micro-batch of `lengths` on `layers` layers."""
    import numpy as np

    from dcp_opt import Batch, CostModel, cluster_preset

    cost = CostModel(spec, cluster_preset(CLUSTER))
    co, tokens = cost.coeffs, float(sum(lengths))
    feats = np.sum([cost.features(s) for s in Batch.from_lengths(lengths).sequences], axis=0)
    fwd, bwd = cost.layer_times(feats[None, :], 1)
    head = tokens * (co.head_fwd_per_token_s + co.head_bwd_per_token_s)
    saved = tokens * (layers * co.act_bytes_per_token_layer + co.head_bytes_per_token)
    return {
        "time_s": float(layers * (fwd[0] + bwd[0]) + head + co.microbatch_overhead_s),
        "saved_bytes": saved,
        "peak_bytes": saved + tokens * co.act_bytes_per_token_layer,
        "coefficients": {
            "act_bytes_per_token_layer": co.act_bytes_per_token_layer,
            "head_bytes_per_token": co.head_bytes_per_token,
            "source": co.source,
        },
    }


# ---- entry -------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="narrow model (CPU tests)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; tiny 2)")
    p.add_argument("--shapes", default=None, help=f"comma list (default {','.join(SHAPES)})")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 3; tiny 1)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--json", default=None, help="write every figure to this file")
    args = p.parse_args(argv)
    args.layers = args.layers if args.layers is not None else (2 if args.tiny else 8)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.tiny else 3)
    if args.layers < 1 or args.repeats < 1:
        p.error("--layers, --repeats: allowed: integers >= 1")
    names = (args.shapes or ",".join(TINY_SHAPES if args.tiny else SHAPES)).split(",")
    try:
        args.shapes = {name: parse_shape(name) for name in names if name}
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)
    how = import_dcp_opt()
    import torch
    from dcp_opt.runtime.attention import choose_kernel
    from dcp_opt.runtime.profile.clocks import CpuClock, CudaClock

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_memory: no CUDA device; run with --device cpu --tiny", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    if args.device == "cpu":  # the shared CPU: one intra-op thread, as the profiler's CPU runs
        torch.set_num_threads(1)
    clock = CudaClock() if args.device == "cuda" else CpuClock(mode="wall")
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    model, state, spec = build(args, dtype)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    kernel = choose_kernel(args.device, dtype, head_dim=head_dim)
    print(f"gpu_memory: dcp_opt from {how}; torch {torch.__version__}; device {name!r}; "
          f"{args.layers} layers of {spec.name} in {dtype}; attention kernel {kernel!r}",
          flush=True)  # fmt: skip
    ok, line = kernel_check(args.device)
    print(line, flush=True)
    if not ok:
        return 1
    rows = []
    for shape, lengths in args.shapes.items():
        got = measure(model, state, lengths, clock, args.repeats)
        want = predict(spec, lengths, args.layers)
        rows.append(Row(
            shape, len(lengths), sum(lengths), got["time_s"], want["time_s"],
            got["saved_bytes"], want["saved_bytes"], got["peak_bytes"], want["peak_bytes"],
            got["calls"]["varlen"], got["calls"]["reference"],
        ))  # fmt: skip
    print_table([_cells(r) for r in rows], HEADER)
    if args.json:
        report = {
            "script": "scripts/gpu_memory.py", "argv": sys.argv[1:] if argv is None else argv,
            "device": name, "torch": torch.__version__, "dtype": args.dtype,
            "layers": args.layers, "model": asdict(spec), "cluster": CLUSTER,
            "kernel": kernel, "coefficients": want["coefficients"],
            "baseline_bytes": _baseline(args.device), "rows": [asdict(r) for r in rows],
            "wall_s": round(time.perf_counter() - t0, 1),
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"gpu_memory: wrote {args.json}")
    return 0


def kernel_check(device: str, tol: float = 3e-2) -> tuple[bool, str]:
    """Before any figure: the varlen kernel against the reference path (compare_kernels). The
    varlen path has no CPU kernel, so on a machine without one this says so and passes."""
    from dcp_opt.runtime import attention as A

    if device != "cuda" or not A.varlen_available():
        return True, "kernel check: varlen not available here; skipped"
    worst = compare_kernels(device, A.varlen_attention)
    ok = worst <= tol
    return ok, f"kernel check: varlen vs reference, worst relative error {worst:.2e} " + (
        "(ok)" if ok else f"ABOVE {tol:g}: varlen gradients are not to be trusted here"
    )


def compare_kernels(device: str, varlen) -> float:
    """`varlen(q, k, v, lengths, k_lengths, causal=, scale=, window=)` on packed bf16 inputs
    (mixed lengths, GQA 8 over 2 heads, causal with and without a window) against the
    reference path on the same inputs in float32: the worst of max |diff| / max |reference|
    over the output and the q/k/v gradients."""
    import torch
    from dcp_opt.runtime import attention as A

    gen = torch.Generator(device=device).manual_seed(0)
    lengths, worst = [37, 200, 5, 64], 0.0
    for window in (None, 16):
        q, k, v = (torch.randn(sum(lengths), h, 64, device=device, generator=gen,
                               dtype=torch.bfloat16) for h in (8, 2, 2))  # fmt: skip
        got, want = [], []
        for fn, dtype in ((varlen, torch.bfloat16), (None, torch.float32)):
            xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
            opts = {"causal": True, "scale": None, "window": window}
            if fn is None:
                out = A._reference_attention(*xs, lengths, lengths, softcap=None, sinks=None,
                                             **opts)  # fmt: skip
            else:
                out = fn(*xs, lengths, lengths, **opts)
            out.float().square().sum().backward()
            (got if fn else want).extend([out.float(), *(x.grad.float() for x in xs)])
        for a, b in zip(got, want, strict=True):
            worst = max(worst, float(((a - b).abs().max() / b.abs().max()).detach()))
    return worst


HEADER = ["shape", "seqs", "tokens", "ms", "pred ms (h200)", "saved MiB", "pred saved",
          "peak MiB", "pred peak", "varlen calls", "ref calls"]  # fmt: skip


def _cells(r: Row) -> list[str]:
    mib = 2.0**20
    peak = "-" if r.peak_bytes is None else f"{r.peak_bytes / mib:.1f}"
    return [
        r.shape, str(r.sequences), str(r.tokens), f"{r.time_s * 1e3:.2f}",
        f"{r.pred_time_s * 1e3:.2f}", f"{r.saved_bytes / mib:.1f}",
        f"{r.pred_saved_bytes / mib:.1f}", peak, f"{r.pred_peak_bytes / mib:.1f}",
        str(r.varlen_calls), str(r.reference_calls),
    ]  # fmt: skip


def _baseline(device: str) -> float | None:
    """Bytes allocated between runs (weights and gradients), CUDA only."""
    import torch

    return float(torch.cuda.memory_allocated()) if device == "cuda" else None


if __name__ == "__main__":
    sys.exit(main())
