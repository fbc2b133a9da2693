"""The model as frozen data: what the cost model needs to know about a transformer."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import DcpOptError, is_int, is_real, require
from .errors import short_repr as _short

KINDS = ("1d", "2d", "3d")
# How a 3d model (full 3-D attention DiT) sees its caption: "joint" (MMDiT: the text tokens
# join the sequence of every attention; SD3, Flux, Open-Sora 2.0, HunyuanVideo) or "cross"
# (Wan: self-attention over the video tokens, then cross-attention to a fixed text length).
TEXT_MODES = ("joint", "cross")
# Integer fields are exact (true is not 1, 2.0 is not 2) and at most 2**31 - 1: a bigger
# width or depth is a typo, and its products (hidden^2 x layers) would leave float64's range.
MAX_FIELD = 2**31 - 1


@dataclass(frozen=True)
class ModelSpec:
    """A 1D decoder LM (`kind="1d"`, one block per layer), a 2D spatial-temporal DiT
    (`kind="2d"`, each layer = one spatial block + one temporal block, as Open-Sora STDiT3) or
    a full-attention video DiT (`kind="3d"`: every layer attends over all F x H x W tokens;
    dcp_opt/dit_spec.py builds one from a diffusers config). 2d and 3d models take the same
    (frames, height, width) samples.

    `text_mode` (3d only): "joint" or "cross" (TEXT_MODES). `single_layers` (joint only): how
    many of the `num_layers` blocks are single-stream (one set of weights for video and text;
    Flux, HunyuanVideo); the others are double-stream (one set per modality; SD3).

    `text_tokens` is the cross-attention context of a 2D model (captions, 300 in Open-Sora).
    `num_kv_heads` is the number of key/value heads of grouped-query attention (Ainslie et al.
    2023, "GQA"; Llama 3, Mistral, Qwen2); None means one per query head (multi-head).
    `num_params` defaults to the count implied by the shapes.
    `window`, `windowed_layers`: sliding-window attention (Mistral, Gemma 2/3, Qwen2 with
    `layer_types`): `windowed_layers` of the 1D layers let a query see only the `window` most
    recent keys of its sequence, itself included (transformers' definition); 0, 0: none.
    Build one from a transformers config with dcp_opt.hf_spec.spec_from_hf_config.
    """

    name: str
    kind: str
    num_layers: int
    hidden: int
    num_heads: int
    ffn_hidden: int
    vocab_size: int = 0
    text_tokens: int = 0
    gated_mlp: bool = False
    causal: bool = True
    dtype_bytes: int = 2
    num_params: float | None = None
    num_kv_heads: int | None = None
    window: int = 0
    windowed_layers: int = 0
    text_mode: str = ""
    single_layers: int = 0

    def __post_init__(self) -> None:
        require(
            self.kind in KINDS, "model.kind", f"{self.kind!r} not allowed; allowed: {list(KINDS)}"
        )
        for f in ("num_layers", "hidden", "num_heads", "ffn_hidden", "dtype_bytes"):
            v = getattr(self, f)
            require(
                is_int(v) and 1 <= v <= MAX_FIELD,
                f"model.{f}",
                f"must be an integer >= 1 (at most 2**31 - 1), got {_short(v)}",
            )
        # Checked too because profile files carry a ModelSpec: a hand-edited one must fail
        # here, naming the field, not later inside the cost model.
        for f in ("vocab_size", "text_tokens", "window", "windowed_layers"):
            v = getattr(self, f)
            require(
                is_int(v) and 0 <= v <= MAX_FIELD,
                f"model.{f}",
                f"must be an integer >= 0 (at most 2**31 - 1), got {_short(v)}",
            )
        for f in ("gated_mlp", "causal"):
            v = getattr(self, f)
            require(isinstance(v, bool), f"model.{f}", f"must be true or false, got {v!r}")
        p = self.num_params
        require(
            p is None or (is_real(p) and 0 < p < 1e30),
            "model.num_params",
            f"must be a finite number > 0 or null (below 1e30), got {_short(p)}",
        )
        require(
            self.hidden % self.num_heads == 0,
            "model.num_heads",
            f"must divide hidden={self.hidden}, got {self.num_heads}",
        )
        kv = self.num_kv_heads
        require(
            kv is None or (is_int(kv) and kv >= 1 and self.num_heads % kv == 0),
            "model.num_kv_heads",
            f"must be null or an integer >= 1 dividing num_heads={self.num_heads}, got {kv!r}",
        )

        self._check_window()
        self._check_text_mode()

    def _check_text_mode(self) -> None:
        m, n = self.text_mode, self.single_layers
        allowed = list(TEXT_MODES) if self.kind == "3d" else [""]
        require(
            m in allowed,
            "model.text_mode",
            f"{m!r} not allowed for a {self.kind} model; allowed: {allowed}",
        )
        require(
            is_int(n) and 0 <= n <= (self.num_layers if m == "joint" else 0),
            "model.single_layers",
            f"must be an integer in [0, num_layers={self.num_layers}] for a joint 3d model, "
            f"else 0; got {_short(n)}",
        )
        require(
            self.kind != "3d" or (not self.causal and self.num_kv_heads is None),
            "model.causal",
            "a 3d model attends over all its tokens: causal false, num_kv_heads null",
        )

    @property
    def input_kind(self) -> str:
        """The kind of the sequences the model takes: "1d" lengths or "2d" (frames, height,
        width) shapes (2d and 3d models alike)."""
        return "1d" if self.kind == "1d" else "2d"

    @property
    def joint_text_tokens(self) -> int:
        """Text tokens that join every attention of a sample: text_tokens under joint, else 0."""
        return self.text_tokens if self.text_mode == "joint" else 0

    def _check_window(self) -> None:
        w, n = self.window, self.windowed_layers
        require(
            n <= self.num_layers and (w == 0) == (n == 0),
            "model.windowed_layers",
            f"must be 0 with window 0, else 1..num_layers={self.num_layers}; got {n} "
            f"with window {w}",
        )
        require(
            n == 0 or (self.kind == "1d" and self.causal),
            "model.window",
            f"{w} not allowed for a {self.kind} model; allowed: causal 1d models",
        )

    @property
    def windowed_share(self) -> float:
        """Share of the layers whose attention has a window (0 without one)."""
        return self.windowed_layers / self.num_layers

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def kv_fraction(self) -> float:
        """Width of k (or v) relative to q: 1 for multi-head attention, kv/H under GQA."""
        return self.kv_heads / self.num_heads

    def a2a_volume_share(self, degree: int) -> float:
        """Bytes a 1D layer's Ulysses all-to-alls move at SP degree `degree`, as a share of
        multi-head attention's (q, k, v, output: 4 x hidden per token). Under GQA k and v go
        with `ulysses_kv_heads` heads each; 2D models move whole activations (share 1)."""
        if self.kind != "1d" or self.num_kv_heads is None:
            return 1.0
        sent = ulysses_kv_heads(self.num_heads, self.kv_heads, degree)
        return (2 + 2 * sent / self.num_heads) / 4

    @property
    def block_types(self) -> tuple[str, ...]:
        if self.kind == "2d":
            return ("spatial", "temporal")
        return ("layer",)  # 1d: one decoder layer; 3d: one full-attention block

    @property
    def params_per_block(self) -> float:
        """Matmul parameters that act on every token of one block."""
        h, f = self.hidden, self.ffn_hidden
        mlp = (3 if self.gated_mlp else 2) * h * f
        if self.kind == "1d":  # q and o are h x h; k and v h x (h * kv/H) under GQA
            return (2 + 2 * self.kv_fraction) * h * h + mlp
        if self.text_mode == "joint":  # per token, double and single blocks alike (dit_spec)
            return 4 * h * h + mlp
        # Self-attention qkvo (4h^2) + cross-attention q and o on video tokens (2h^2) + MLP.
        return 6 * h * h + mlp

    @property
    def total_params(self) -> float:
        if self.num_params is not None:
            return float(self.num_params)
        h = self.hidden
        per_layer = len(self.block_types) * self.params_per_block
        if self.kind == "2d" or self.text_mode == "cross":
            per_layer += len(self.block_types) * 2 * h * h  # cross-attention k, v on text
        return float(self.num_layers * per_layer + 2 * self.vocab_size * h)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["num_kv_heads"] is None:  # multi-head: the same document (and fingerprints) as
            del d["num_kv_heads"]  # before the field existed
        if d["windowed_layers"] == 0:  # no window: likewise
            del d["window"], d["windowed_layers"]
        if d["text_mode"] == "":  # 1d and 2d: likewise
            del d["text_mode"], d["single_layers"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        try:
            return cls(**d)
        except TypeError as e:
            raise DcpOptError(f"model: {e}") from None


def ulysses_kv_heads(num_heads: int, num_kv_heads: int, degree: int) -> int:
    """How many key/value heads a Ulysses all-to-all moves at SP degree `degree` (the
    runtime, runtime/hf.py, and the cost model both use this rule).

    Ulysses gives member j query heads [j H/d, (j+1) H/d) (Jacobs et al. 2023, sec. 3); under
    GQA query head i reads kv head i // (H / kv). So when d divides kv, member j needs exactly
    kv heads [j kv/d, (j+1) kv/d): send kv heads. When kv divides d (and d divides H), every
    member needs one kv head: repeat each d/kv times and send d heads. Otherwise the kv heads
    are repeated to one per query head before the all-to-all (multi-head volume)."""
    if num_kv_heads % degree == 0:
        return num_kv_heads
    if degree % num_kv_heads == 0 and num_heads % degree == 0:
        return degree
    return num_heads


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Llama 3.2 1B: 16 layers, hidden 2048, 32 heads, SwiGLU 8192, vocab 128256 (tied).
    "llama-1b": ModelSpec(
        "llama-1b", "1d", 16, 2048, 32, 8192, vocab_size=128256, gated_mlp=True, num_params=1.24e9
    ),
    # Llama 2 7B: 32 layers, hidden 4096, 32 heads, SwiGLU 11008, vocab 32000.
    "llama-7b": ModelSpec(
        "llama-7b", "1d", 32, 4096, 32, 11008, vocab_size=32000, gated_mlp=True, num_params=6.74e9
    ),
    # Llama 3.1 8B: 32 layers, hidden 4096, 32 query and 8 key/value heads (GQA), SwiGLU
    # 14336, vocab 128256 (untied).
    "llama3-8b": ModelSpec(
        "llama3-8b",
        "1d",
        32,
        4096,
        32,
        14336,
        vocab_size=128256,
        gated_mlp=True,
        num_params=8.03e9,
        num_kv_heads=8,
    ),
    # Llama 3 70B (Meta's config.json for Meta-Llama-3-70B): 80 layers, hidden 8192, 64
    # query and 8 key/value heads (GQA), SwiGLU 28672, vocab 128256 (untied); 70.6e9
    # parameters (the count the shapes give).
    "llama3-70b": ModelSpec(
        "llama3-70b",
        "1d",
        80,
        8192,
        64,
        28672,
        vocab_size=128256,
        gated_mlp=True,
        num_kv_heads=8,
    ),
    # Open-Sora 1.2 STDiT3-XL/2: 28 layers of (spatial, temporal) blocks, hidden 1152,
    # 16 heads, MLP ratio 4, captions of 300 T5 tokens.
    "opensora-stdit3-xl": ModelSpec(
        "opensora-stdit3-xl",
        "2d",
        28,
        1152,
        16,
        4608,
        text_tokens=300,
        causal=False,
        num_params=1.1e9,
    ),
    # Full-attention video DiTs (kind 3d): dimensions and caption lengths from the published
    # configs as dcp_opt/dit_spec.py PUBLISHED cites them; num_params = the diffusers model
    # built from that config, to the parameter (dit_spec.published_spec; tests/test_dit_spec.py
    # and scripts/check_dit_params.py check both). Open-Sora 2.0: Flux MMDiT, 19 double- + 38
    # single-stream blocks, hidden 3072, 24 heads, MLP 4x, T5 captions of 512 tokens.
    "opensora2-11b": ModelSpec(
        "opensora2-11b",
        "3d",
        57,
        3072,
        24,
        12288,
        text_tokens=512,
        causal=False,
        num_params=11891178560.0,
        text_mode="joint",
        single_layers=38,
    ),
    # HunyuanVideo (HYVideo-T/2-cfgdistill): 20 double- + 40 single-stream blocks, hidden
    # 3072, 24 heads, MLP 4x, 256 text tokens.
    "hunyuanvideo-13b": ModelSpec(
        "hunyuanvideo-13b",
        "3d",
        60,
        3072,
        24,
        12288,
        text_tokens=256,
        causal=False,
        num_params=12821012544.0,
        text_mode="joint",
        single_layers=40,
    ),
    # Wan 2.1 T2V 14B: 40 blocks, hidden 5120, 40 heads, FFN 13824, umT5 captions of 512.
    "wan2.1-14b": ModelSpec(
        "wan2.1-14b",
        "3d",
        40,
        5120,
        40,
        13824,
        text_tokens=512,
        causal=False,
        num_params=14288491584.0,
        text_mode="cross",
    ),
    # Wan 2.1 T2V 1.3B: 30 blocks, hidden 1536, 12 heads, FFN 8960, umT5 captions of 512.
    "wan2.1-1.3b": ModelSpec(
        "wan2.1-1.3b",
        "3d",
        30,
        1536,
        12,
        8960,
        text_tokens=512,
        causal=False,
        num_params=1418996800.0,
        text_mode="cross",
    ),
}


def model_preset(name: str) -> ModelSpec:
    if name not in MODEL_PRESETS:
        raise DcpOptError(f"model: unknown preset {name!r}; allowed: {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]
