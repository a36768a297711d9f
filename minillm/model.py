"""Llama, the architecture of SmolLM2, over a flat batch of tokens.

There is no batch dimension: a step feeds ``input_ids[T]`` and ``positions[T]`` for
tokens of many sequences laid end to end, and attention (attention.py) keeps the
sequences apart. Everything except attention is per token, so it does not care which
sequence a token belongs to. The same forward serves a whole prompt, one decode
token, a prefill chunk, or k+1 tokens of speculative verification.

Blocks: embedding -> N x [RMSNorm -> attention (RoPE, GQA) -> residual ->
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> tied LM head.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import seams
from .attention import BACKENDS, AttentionMetadata, cpu_attention_rows, torch_attention, write_and_attend
from .config import ModelConfig
from .kernels.cpu import build as cpu_build
from .kernels.cpu import layer_ops
from .kernels.rmsnorm import rms_norm_ref
from .quantization import QuantizedLinear

# x / rms(x) * weight in float32, rounded to x.dtype where transformers rounds: the model's norm
# is the Triton kernel's oracle itself (one body, kernels/rmsnorm.py), so the two cannot drift.
rms_norm = rms_norm_ref

# The seams of the forward (``minillm/seams.py``) that the cpu backend's fused layer ops, a
# compiled step (compiled.py) and a captured CUDA graph (model_runner.DecodeGraphs) would go
# around: chapter 0's norm and RoPE, chapter 3's K/V store, chapter 10's MLP of a
# tensor-parallel rank. While one is plugged, those step aside and the plain layer loop
# below runs, calling it.
FORWARD_SEAMS = ("rms_norm", "apply_rope", "store_kv_triton", "parallel_mlp")


def forward_seam_plugged() -> bool:
    """Whether a learner's function is plugged into one of ``FORWARD_SEAMS``: then only the
    plain layer loop (``Llama.forward`` without ``_cpu_layers``, eagerly) runs it."""
    return any(seams.plugged(name) is not None for name in FORWARD_SEAMS)


def _plugged(name: str):
    """``seams.plugged(name)``, or None while torch.compile traces the forward: a compiled
    step runs only while nothing in ``FORWARD_SEAMS`` is plugged (compiled.py steps aside to
    the eager forward), so its graph holds the library's code and no guard on the seams."""
    return None if torch.compiler.is_compiling() else seams.plugged(name)


class _LayerParts(NamedTuple):
    """What ``Llama._cpu_layers`` uses of a decoder layer: its projections, (weight, eps) of its
    norms, and its attention's scale."""

    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module
    input_norm: tuple[torch.Tensor, float]
    post_attn_norm: tuple[torch.Tensor, float]
    scale: float


def _norm_parts(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm._parameters["weight"], norm.eps


def _layer_parts(layer: nn.Module) -> _LayerParts:
    """A layer's parts, read from the modules' own dictionaries once per forward: nn.Module's
    attribute lookup is a Python call (under a microsecond), and the loop would make some 500
    a step."""
    attn, mlp = layer._modules["attn"]._modules, layer._modules["mlp"]._modules
    return _LayerParts(attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"],
                       _norm_parts(layer._modules["input_norm"]), _norm_parts(layer._modules["post_attn_norm"]),
                       layer._modules["attn"].scale)


def _rows(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for the CPU layers' rows [T, K]; a quantized layer's kernel straight away
    (``QuantizedLinear.rows_on_cpu``: a 4-bit layer's kernel takes about as long as a module call)."""
    return linear.rows_on_cpu(x) if type(linear) is QuantizedLinear else linear(x)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for the "rotate half" RoPE layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]: the same angle for i and i + D/2
    return emb.cos(), emb.sin()


class RopeTable:
    """cos, sin of every position up to the model's context length, built once on the device.

    ``rope_cos_sin`` recomputes the angles of a step's positions each forward, on the host
    side of the positions' device; a serving step instead gathers rows of a table that
    lives next to the weights, so the step uploads nothing for RoPE and launches one
    gather. Row p holds exactly what ``rope_cos_sin`` gives for position p (the same
    inverse frequencies, the same float32 product), so the numbers do not change.
    """

    def __init__(self, max_positions: int, head_dim: int, theta: float, device: torch.device | str):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
        pos = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :].to(device)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.device = torch.device(device)
        self.cos, self.sin = emb.cos(), emb.sin()

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + D/2]) by its position's angle.

    x: [T, H, D]; cos, sin: [T, D]. Returns [T, H, D] in x.dtype.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
    y = x * cos[:, None, :] + rotated * sin[:, None, :]
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _same_layout(seam: str, out, x: torch.Tensor) -> None:
    """A plugged forward seam returns a tensor of x's shape and dtype: the next layer reads it as such."""
    if not isinstance(out, torch.Tensor):
        raise seams.SeamContractError(seam, "it returns a tensor of x's shape and dtype",
                                      f"a {type(out).__name__} for x {list(x.shape)} {x.dtype}")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise seams.SeamContractError(seam, "it returns a tensor of x's shape and dtype",
                                      f"{list(out.shape)} {out.dtype} for x {list(x.shape)} {x.dtype}")


def _checked_norm(out, x: torch.Tensor) -> torch.Tensor:
    """A plugged ``rms_norm``'s answer, checked before the layer uses it (chapter 0's contract):
    x's shape and dtype, and finite wherever x is (the statistics in float32 cannot overflow)."""
    _same_layout("rms_norm", out, x)
    bad = ~torch.isfinite(out) & torch.isfinite(x)
    if bool(bad.any()):
        raise seams.SeamContractError(
            "rms_norm", "it returns finite values wherever x is finite (mean(x ** 2) taken in float32)",
            f"{int(bad.sum())} of {out.numel()} values inf or NaN, x {list(x.shape)} {x.dtype} with |x| up to "
            f"{float(x.abs().max()):.4g}")
    return out


def _plugged_rope(mine, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A plugged ``apply_rope``, its answer checked before attention uses it (chapter 0's contract):
    x's shape and dtype, and every head vector keeps its norm (a rotation does). The norms are
    taken before the call, in case the function rotates x in place."""
    before = x.float().norm(dim=-1)  # [T, H]
    out = mine(x, cos, sin)
    _same_layout("apply_rope", out, x)
    after = out.float().norm(dim=-1)
    rtol = 1e-4 if x.dtype in (torch.float32, torch.float64) else 2e-2
    off = (after - before).abs() > 1e-5 + rtol * before
    off |= ~torch.isfinite(after)
    if bool(off.any()):
        t, h = (int(i) for i in off.nonzero()[0])
        raise seams.SeamContractError(
            "apply_rope", "a rotation preserves the norm of every head vector",
            f"token {t}, head {h}: norm {float(before[t, h]):.6g} before, {float(after[t, h]):.6g} after "
            f"({int(off.sum())} of {off.numel()} head vectors changed norm)")
    return out


class RMSNorm(nn.Module):
    """``rms_norm``; with the Triton backend on a GPU, the Triton kernel (one pass per row);
    a learner's ``rms_norm`` (chapter 0) when one is plugged into its seam."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_triton = False  # set by Llama.set_attention_backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = _plugged("rms_norm")  # a learner's norm (chapter 0), when plugged in
        if mine is not None:
            return _checked_norm(mine(x, self.weight, self.eps), x)
        if self.use_triton and x.is_cuda:
            from minillm.kernels.rmsnorm import rms_norm as triton_rms_norm

            return triton_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------- packed CPU weights

PACK_ROWS = 32  # the batch size oneDNN lays packed weights out for; measured: good from 1 to 256 rows


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


_PACKING: dict[torch.dtype, bool] = {}


def packs_by_default(dtype: torch.dtype) -> bool:
    """Where ``pack_weights=None`` packs: on an x86 CPU, float32, and bfloat16 where the CPU
    has bf16 matrix instructions, where it was measured to pay (and this torch runs it);
    elsewhere ``pack_weights=True`` asks for it. (bf16 decode steps of SmolLM2 on a 2-core
    AVX512-BF16 CPU, plain and packed alternating in one process: 21.3 / 21.6 ms plain,
    15.5 / 17.0 ms packed at batch 1 / 8.)"""
    import platform

    from .placement import cpu_has_bf16_matmul

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if dtype == torch.bfloat16 and not cpu_has_bf16_matmul():
        return False
    return dtype in (torch.float32, torch.bfloat16) and can_pack_weights(dtype)


def can_pack_weights(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run oneDNN's packed linear in ``dtype`` (tried once, on a tiny matrix)."""
    if dtype not in _PACKING:
        try:
            w, x = torch.randn(16, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
            y = _packed_linear(x, _pack(w))
            _PACKING[dtype] = tuple(y.shape) == (3, 16) and bool(torch.allclose(y.float(), F.linear(x, w).float(),
                                                                                 atol=1e-2, rtol=1e-2))
        except (RuntimeError, AttributeError, NotImplementedError):
            _PACKING[dtype] = False
    return _PACKING[dtype]


class PackedLinear(nn.Module):
    """``nn.Linear`` without bias whose weight lives in oneDNN's blocked layout for this CPU.

    A plain fp32 ``F.linear`` on the CPU goes to a GEMM that rereads the weight in its
    row-major layout every call; oneDNN's packed layout lets a few rows (a decode
    batch) stream the weight once at full width. Same arithmetic, different summation
    order: results differ from ``F.linear`` by rounding (~1e-6 in fp32), not by
    algorithm. ``weight`` is still the layer's one parameter (same name, shape and
    element count), but opaque: ``dense()`` gives it back as a plain tensor.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(_pack(weight), requires_grad=False)

    def dense(self) -> torch.Tensor:
        return self.weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inside LLM(compile=True)'s graph: an opaque op (compiled.py)
            return torch.ops.minillm.packed_linear(x, self.weight, self.out_features)
        return _packed_linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed (oneDNN)"


# ---------------------------------------------------------------- the model

CPU_LAYER_DTYPES = cpu_build.DTYPES  # what the cpu backend's layer ops take: float32, bfloat16 (else: the loop)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx  # which of the step's KV caches is this layer's (compiled.py)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache, backend) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        # RoPE on the query and key heads in one go: they are adjacent in the projection,
        # and the rotation is per head, so this is the same arithmetic as rotating each.
        mine = _plugged("apply_rope")  # a learner's RoPE (chapter 0), when plugged in
        qk = qk.view(T, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        qk = apply_rope(qk, cos, sin) if mine is None else _plugged_rope(mine, qk, cos, sin)
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]  # [T, Hq, D], [T, Hkv, D]
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        if meta is None:  # inside a compiled step (compiled.py): the same, as one opaque op
            o = torch.ops.minillm.attention(q, k, v, self.layer_idx, self.scale)
        else:
            o = write_and_attend(backend, q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # SwiGLU
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, meta, kv_cache, backend):
        h = h + self.attn(self.input_norm(h), cos, sin, meta, kv_cache, backend)
        return h + self.mlp(self.post_attn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch"):
        super().__init__()
        self.cfg = cfg
        # Weights come from load_weights: the embedding skips its random init (normal_,
        # which on the meta device where build_model builds costs a 2 s import of torch's compiler).
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RopeTable | None = None  # built on the weights' device (build_model, or the first forward)
        self.packed_head: torch.Tensor | None = None  # the LM head in oneDNN's layout (pack_weights)
        self.quantized_head: nn.Module | None = None  # the LM head quantized (quantization.quantize_model)
        self.set_attention_backend(attention_backend)

    def build_rope(self) -> RopeTable:
        """The RoPE table on the weights' device (again if the model has moved)."""
        dev = self.embed.weight.device
        if self.rope is None or self.rope.device != dev:
            self.rope = RopeTable(self.cfg.max_position_embeddings, self.cfg.head_dim, self.cfg.rope_theta, dev)
        return self.rope

    def set_attention_backend(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
        self.attention_backend = name
        self._backend = BACKENDS[name]
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.use_triton = name == "triton"

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden].

        ``meta`` and ``kv_caches`` None: traced by ``compiled.CompiledForward``, whose
        attention op finds them in the step's context.
        """
        cos, sin = self.build_rope()(positions)  # [T, D] each, float32
        h = self.embed(input_ids)  # [T, hidden]
        if cos.dtype != h.dtype:
            cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        if (self.attention_backend == "cpu" and meta is not None and h.dtype in CPU_LAYER_DTYPES and not h.is_cuda
                and not forward_seam_plugged()):  # a plugged norm, RoPE or K/V store: the loop below calls it
            return self._cpu_layers(h, cos, sin, meta, kv_caches)
        for layer, kv in zip(self.layers, kv_caches if kv_caches is not None else [None] * len(self.layers)):
            h = layer(h, cos, sin, meta, kv, self._backend)
        return self.norm(h)

    def _cpu_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The layers above with the ``cpu`` backend: the same matmuls, and the work between
        them in four C++ calls a layer (``kernels/cpu/layer_ops.py``) instead of some forty ops.

        The residual stream ``h`` and its normed copy ``n`` travel together: each residual
        add is fused with the norm that follows it (the next layer's input norm, or the
        final one), and ``h`` is updated in place. ``ForwardOps`` checks once per forward
        what every layer shares, so a layer's calls pass pointers. The numbers are those of
        the loop above but for float rounding in a norm's sum of squares and in silu's exp
        (tests/test_cpu_layer_ops.py).

        Attention takes the route of ``attention.cpu_attention`` (the backend's entry in
        ``BACKENDS``, which the loop above and a compiled step call): the step's rows from
        ``cpu_attention_rows``, or ``torch_attention`` where that says the kernel does not
        attend this step. Only the binding differs: ``ForwardOps`` binds the rows to its query
        and output buffers and every layer's caches once per forward, and a layer passes its
        index, where ``cpu_attention`` checks its tensors at each call.

        Not while a learner's function is plugged into a seam of ``FORWARD_SEAMS``: these calls
        would go around it, so ``forward`` runs the loop above instead.
        """
        T, cfg = h.shape[0], self.cfg
        rows = cpu_attention_rows(meta, h.dtype)  # None: a learner's decode attention is plugged in (chapter 3)
        ops = layer_ops.ForwardOps(h, cos, sin, meta, cfg.num_heads, kv_caches, cfg.intermediate_size, rows)
        parts = [_layer_parts(layer) for layer in self.layers]
        norms = [p.input_norm for p in parts[1:]] + [_norm_parts(self.norm)]  # each layer's next norm
        weight, eps = parts[0].input_norm
        n = ops.add_norm(None, h, weight, eps)  # h: the residual stream, updated in place
        for i, (p, (k_cache, v_cache)) in enumerate(zip(parts, kv_caches)):
            q = ops.rope_write(_rows(p.qkv_proj, n), i)  # [T, Hq, D]; this step's K/V in layer i's cache
            if rows is not None:
                o = ops.attend(i, p.scale)
            else:
                o = torch_attention(q, k_cache, v_cache, meta, p.scale)
            n = ops.add_norm(_rows(p.o_proj, o.view(T, cfg.q_size)), h, *p.post_attn_norm)
            n = ops.add_norm(_rows(p.down_proj, ops.silu_mul(_rows(p.gate_up_proj, n))), h, *norms[i])
        return n

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab], only for the rows that sample."""
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()
        if self.packed_head is not None:
            return _packed_linear(hidden, self.packed_head).float()
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()

    def pack_weights(self) -> None:
        """Every projection and the LM head in oneDNN's packed layout (CPU; ``PackedLinear``).

        The projections are replaced (their memory is reused); the tied head keeps the
        embedding's dense rows for lookups, so packing it costs one more copy of that
        matrix (113 MB in fp32 for SmolLM2-135M). Call on a model already on the CPU in
        its final dtype; it is not moved afterwards.
        """
        for layer in self.layers:
            for parent, name in ((layer.attn, "qkv_proj"), (layer.attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                m = getattr(parent, name)
                if isinstance(m, nn.Linear):
                    setattr(parent, name, PackedLinear(m.weight))
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        self.packed_head = _pack(w)


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                dtype: torch.dtype, attention_backend: str = "torch", pack_weights: bool = False) -> Llama:
    """A Llama on ``device`` in ``dtype``; ``pack_weights`` (CPU only): ``Llama.pack_weights``."""
    with torch.device("meta"):
        model = Llama(cfg, attention_backend)
    model = model.to_empty(device="cpu")
    model.load_weights(weights)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.build_rope()
    if pack_weights:
        model.pack_weights()
    return model
