"""Weight-only quantization: the linear layers and the LM head read 8-bit or 4-bit weights.

A decode step reads every weight once, and at small batch that read is the step's floor
(chapter 0): SmolLM2-135M's 135 M weights are 538 MB in float32. Storing them in fewer
bits lowers the floor in proportion; the activations stay float32 (or bfloat16, in a bfloat16
engine), so only the weights' rounding can change the numbers.

Formats of one layer (``QuantizedLinear``), all for a weight [N, K]:

- ``"int8_channel"``: int8 codes in [-127, 127], one float32 scale per output row
  (``scale = max|w[n, :]| / 127``, w ≈ q * scale): 8 bits a weight plus 32 a row.
- ``"int8_group"``: 8-bit codes in [0, 255] in groups of ``GROUP_SIZE`` = 32 along K, each
  group with a float32 scale and minimum (w ≈ q * scale + min): 8 + 64/32 = 10 bits a weight.
  Quantized asymmetrically (min and max of the group) or symmetrically (``symmetric=True``:
  scale = max|w| / 127, min = -128 * scale, the grid of a signed int8 code).
- ``"q4_group"``: 4-bit codes in [0, 15], the same groups, scale and minimum: 6 bits a weight.
  Two codes a byte (element 2j in the low nibble, 2j + 1 in the high one).

What the model gets (``LLM(quantization=...)``):

- ``"int8"``: every projection ``int8_group``; ``"q4"``: every projection ``q4_group``.
- Either way the LM head is ``int8_group``, symmetric: SmolLM2's head is its embedding
  table, whose rows a lookup reads in float32 (one row a token, no matmul); the head's own
  copy is quantized.

Why groups, and why these: the GGUF the weights come from stores every projection as Q4_1
(groups of 32 weights, a float16 scale and minimum, 4-bit codes) and the embedding as Q8_0
(groups of 32, a float16 scale, signed 8-bit codes). The float32 weights the loader makes are
those grids dequantized, and a format whose grid contains them stores them exactly: 4-bit or
8-bit asymmetric groups of 32 for the projections (a Q4_1 step ``d`` is 17 steps of the 8-bit
grid over the same range), symmetric 8-bit groups for the head. One scale per row
(``int8_channel``) does not contain them and rounds every weight again:
``python -m minillm.bench.quant_measure`` measures what that costs.

``QuantizedLinear`` runs the CPU kernels of ``kernels/cpu/quant_matmul.cpp`` (float32 or
bfloat16 activations, float32 arithmetic); their oracles are in ``kernels/cpu/quant.py``. A
layer binds its weights to the kernel once (``quant.BoundLinear``: a call then checks only x),
and where float16 holds every scale and minimum exactly -- the GGUF's own are float16, so for
SmolLM2's file it does -- the kernel reads float16 copies of them: the same results bit for bit,
from 5 bits a 4-bit weight instead of 6 (9 instead of 10 for 8-bit codes). ``nbytes`` counts
what the layer stores (float32 scales), ``read_nbytes`` what its forward on the CPU streams.
Each output element is summed in an order that does not depend on the other rows of the
batch, so a request's tokens do not depend on what it is batched with
(tests/test_quantization.py). On CUDA it runs the Triton kernels of ``kernels/quant_gemv.py``
(activations in float32, float16 or bfloat16, float32 scales), checked against their oracle in
Triton's interpreter, compiled ahead of time, and run on a GPU by the ``gpu`` tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import seams
from .config import QUANTIZATIONS as SCHEMES
from .kernels.cpu.quant import BoundLinear, half_holds, q4_pack, q4_unpack

GROUP_SIZE = 32
CPU_ACTIVATIONS = (torch.float32, torch.bfloat16)  # what the CPU kernels take (and give back)
FORMATS = ("int8_channel", "int8_group", "q4_group")
LAYER_FORMAT = {"int8": "int8_group", "q4": "q4_group"}  # a scheme's projections; its head: symmetric int8_group


def check_scheme(scheme: str | None) -> None:
    """None or one of ``SCHEMES``; else a ValueError that lists them."""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"quantization must be None (float weights) or one of {', '.join(map(repr, SCHEMES))}, "
                         f"got {scheme!r}")


# ---------------------------------------------------------------- one scale per row

def quantize_int8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], scale float32 [N]) with weight ≈ q * scale[:, None]."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # an all-zero row: q = 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that ``(q, scale)`` stands for."""
    return q.float() * scale[:, None]


# ---------------------------------------------------------------- groups along K

def quantize_groups(weight: torch.Tensor, bits: int, group_size: int = GROUP_SIZE, symmetric: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes uint8 [N, K] in [0, 2**bits - 1], scales, mins float32 [N, K/G]).

    Group g of row n covers columns g*G .. g*G + G - 1 and stands for
    ``codes * scale + min``. Asymmetric: min and max of the group are the grid's ends.
    Symmetric (8 bits only): scale = max|w| / 127 and min = -128 * scale, the grid of a signed
    code in [-127, 127] (shifted by 128).
    """
    N, K = weight.shape
    if K % group_size:
        raise ValueError(f"K = {K} is not a multiple of the group size {group_size}")
    top = 2 ** bits - 1
    w = weight.detach().float().reshape(N, K // group_size, group_size)
    if symmetric:
        if bits != 8:
            raise ValueError("symmetric groups are 8-bit (a signed code and a scale)")
        amax = w.abs().amax(dim=-1)
        scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        mins = -128.0 * scales
        q = (torch.round(w / scales[..., None]).clamp_(-127, 127) + 128).to(torch.uint8)
    else:
        mins, maxs = w.amin(dim=-1), w.amax(dim=-1)
        scales = (maxs - mins) / top
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: every code 0
        q = torch.round((w - mins[..., None]) / scales[..., None]).clamp_(0, top).to(torch.uint8)
    return q.reshape(N, K).contiguous(), scales.contiguous(), mins.contiguous()


def _checked_groups(out, shape: torch.Size, bits: int, group_size: int):
    """A learner's ``quantize_groups`` result, held to its contract before a layer keeps it (a
    ``seams.SeamContractError`` that says what came back, never a crash inside a kernel): codes
    uint8 [N, K] within the ``bits``-bit range, float32 scales and minimums [N, K / G], finite
    (a NaN would reach every logit). How close the grid comes to the weight is not checked: a rougher
    grid makes a worse model, not a broken engine."""
    N, K = shape

    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError("quantize_groups", invariant, got)

    want = {"codes": ((N, K), torch.uint8), "scales": ((N, K // group_size), torch.float32),
            "mins": ((N, K // group_size), torch.float32)}
    if not (isinstance(out, tuple) and len(out) == 3):
        raise broken("quantize_groups must return (codes, scales, mins)", type(out).__name__)
    for (name, (shp, dtype)), t in zip(want.items(), out):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shp or t.dtype != dtype:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise broken(f"{name} must be {dtype} {list(shp)}", got)
    codes, scales, mins = (t.contiguous() for t in out)
    if int(codes.max()) > 2 ** bits - 1:
        raise broken(f"{bits}-bit codes must be <= {2 ** bits - 1}", str(int(codes.max())))
    if not (bool(scales.isfinite().all()) and bool(mins.isfinite().all())):
        raise broken("every scale and minimum is a finite number", "nan or inf in the scales or the minimums")
    return codes, scales, mins


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that ``(codes, scales, mins)`` stands for (codes unpacked)."""
    N, K = codes.shape
    G = K // scales.shape[1]
    return (codes.float().view(N, -1, G) * scales[..., None] + mins[..., None]).view(N, K)


def bits_per_weight(fmt: str | None, group_size: int = GROUP_SIZE, in_features: int = 576) -> float:
    """Bits read per weight, scales and minimums included."""
    return {None: 32.0, "int8_channel": 8.0 + 32.0 / in_features, "int8_group": 8.0 + 64.0 / group_size,
            "q4_group": 4.0 + 64.0 / group_size}[fmt]


# ---------------------------------------------------------------- the layer

class QuantizedLinear(nn.Module):
    """A bias-free linear layer holding its weight in ``fmt`` (one of ``FORMATS``): y = x @ w.T
    with w the dequantized weight, computed by a CPU kernel that never writes w out.

    Activations [..., K]: float32 or bfloat16 on the CPU (a C++ kernel, float32 arithmetic),
    float32 / float16 / bfloat16 on CUDA (a Triton kernel, ``forward_triton``); the result
    [..., N] is in their dtype.
    ``dense()`` gives the dequantized weight back (what the oracle multiplies by).
    """

    def __init__(self, weight: torch.Tensor, fmt: str, group_size: int = GROUP_SIZE, symmetric: bool = False):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self._bound: BoundLinear | None = None  # the CPU kernel with this layer's weights (``_cpu_matmul``)
        self.out_features, self.in_features = weight.shape
        self.group_size = None if fmt == "int8_channel" else group_size
        self.mins: torch.Tensor | None
        if fmt == "int8_channel":
            q, scale = quantize_int8_channel(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale)
            self.mins = None
            return
        bits = 8 if fmt == "int8_group" else 4
        mine = None if symmetric else seams.plugged("quantize_groups")  # a learner's (chapter 11), when plugged in
        if mine is not None:
            codes, scales, mins = _checked_groups(mine(weight.detach().float(), bits, group_size), weight.shape,
                                                  bits, group_size)
        else:
            codes, scales, mins = quantize_groups(weight, bits, group_size, symmetric)
        self.register_buffer("qweight", codes if fmt == "int8_group" else q4_pack(codes))
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    def dense(self) -> torch.Tensor:
        if self.fmt == "int8_channel":
            return dequantize_int8_channel(self.qweight, self.scales)
        codes = self.qweight if self.fmt == "int8_group" else q4_unpack(self.qweight)
        return dequantize_groups(codes, self.scales, self.mins)

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's weight as it stores them: codes, float32 scales and minimums."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    @property
    def read_nbytes(self) -> int:
        """Bytes a forward on the CPU streams: ``nbytes``, but 2 bytes a scale and a minimum where
        float16 holds every one of them exactly (the kernel then reads float16 copies)."""
        if self.mins is None or not (half_holds(self.scales) and half_holds(self.mins)):
            return self.nbytes
        return self.qweight.numel() * self.qweight.element_size() + 2 * (self.scales.numel() + self.mins.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.forward_triton(x)
        if x.dtype not in CPU_ACTIVATIONS or not x.is_cpu:
            raise ValueError(f"quantized layers take float32 or bfloat16 activations on the CPU (or "
                             f"float32/float16/bfloat16 on CUDA), got {x.dtype} on {x.device}")
        return self._rows(x, self._cpu_matmul)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ w.T by the Triton GEMV of ``kernels/quant_gemv.py`` (what ``forward`` runs on
        CUDA; on CPU tensors it runs in Triton's interpreter, which is how it is tested here)."""
        if self.fmt == "int8_channel":
            raise ValueError("int8_channel (one scale per row) has no Triton kernel: use int8_group or q4_group")
        return self._rows(x, self._triton_matmul)

    def _rows(self, x: torch.Tensor, matmul) -> torch.Tensor:
        """x [..., K] as contiguous rows [M, K]; y [M, N] by a learner's plugged function, else by
        ``matmul``; back to [..., N]."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., in_features] = [..., {self.in_features}], got {tuple(x.shape)}")
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = self._learners_forward(x2) if self.fmt != "int8_channel" else None
        y = matmul(x2) if y is None else y
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def rows_on_cpu(self, x2: torch.Tensor) -> torch.Tensor:
        """y [T, N] for rows x2 [T, K] on the CPU: the bound kernel, straight away. The CPU layers
        of ``model.Llama`` call this some 120 times a decode step, where the module's call and
        its checks would cost as much as a 4-bit layer's kernel; it takes the module's own path
        until the layer is bound (so a forward that never binds it, the Triton path's in
        tests/test_quantization_triton.py, sees every call), and while a learner's function is plugged
        in (chapter 11)."""
        bound, buffers = self._bound, self._buffers
        if (bound is None or seams.plugged("int8_gemv_triton") is not None
                or seams.plugged("dequantize_groups") is not None
                or not bound.holds(buffers["qweight"], buffers["scales"], buffers.get("mins"))):
            return self(x2)
        return bound(x2)  # checks x2 itself

    def _cpu_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        bound, buffers = self._bound, self._buffers  # (the buffers' dict: faster than nn.Module's attribute lookup)
        if bound is None or not bound.holds(buffers["qweight"], buffers["scales"], buffers.get("mins")):
            kernel = {"int8_channel": "int8", "int8_group": "u8", "q4_group": "q4"}[self.fmt]
            bound = self._bound = BoundLinear(kernel, self.qweight, self.scales, self.mins, self.group_size)
        return bound(x2)

    def _triton_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        from .kernels.quant_gemv import q4_gemv, u8_gemv

        gemv = u8_gemv if self.fmt == "int8_group" else q4_gemv
        return gemv(x2, self.qweight, self.scales, self.mins, self.group_size)

    def _learners_forward(self, x2: torch.Tensor) -> torch.Tensor | None:
        """y [M, N] from a learner's plugged ``int8_gemv_triton`` (8-bit groups) or
        ``dequantize_groups`` (chapter 11); None when neither is plugged."""
        gemv = seams.plugged("int8_gemv_triton") if self.fmt == "int8_group" else None
        if gemv is not None:  # float32 activations, as the exercise's kernel takes them
            y = gemv(x2.float(), self.qweight, self.scales, self.mins, self.group_size)
            return _checked_float32(y, (x2.shape[0], self.out_features), "int8_gemv_triton", "y").to(x2.dtype)
        dequant = seams.plugged("dequantize_groups")
        if dequant is not None:
            codes = self.qweight if self.fmt == "int8_group" else q4_unpack(self.qweight)
            w = _checked_float32(dequant(codes, self.scales, self.mins), tuple(codes.shape), "dequantize_groups",
                                 "the weight")
            return F.linear(x2.float(), w).to(x2.dtype)
        return None

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The oracle: the dequantized weight, multiplied in float64 and rounded to float32 (then
        to x's dtype, as the kernels round)."""
        return F.linear(x.double(), self.dense().double()).float().to(x.dtype)

    def __getstate__(self):  # a copy (deepcopy, pickle) binds its own weights on its first call
        state = self.__dict__.copy()
        state["_bound"] = None
        return state

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}{g}"


def _checked_float32(t, shape: tuple[int, int], seam: str, name: str) -> torch.Tensor:
    """What a learner's plugged function returned, before the layer uses it: float32 of ``shape``."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise seams.SeamContractError(seam, f"{name} is float32 {list(shape)}", got)
    return t


PROJECTIONS = (("attn", "qkv_proj"), ("attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def quantize_model(model: nn.Module, scheme: str | None, layer_format: str | None = None,
                   source: nn.Module | None = None) -> nn.Module:
    """``model`` (a ``model.Llama``) with every projection of every layer in the scheme's
    format (or ``layer_format``, to compare formats) and the LM head in symmetric 8-bit
    groups, in place; returns the model.

    The weights are read from ``source`` (default: ``model`` itself), a float32 model on the
    CPU with the same layers: a model on CUDA in bfloat16 is quantized from the float32 weights
    (the file's own grids, held exactly) rather than from its rounded copies; the quantized
    layers then move to ``model``'s device."""
    check_scheme(scheme)
    if scheme is None:
        return model
    fmt = layer_format or LAYER_FORMAT[scheme]
    src = model if source is None else source
    if src.embed.weight.dtype != torch.float32 or src.embed.weight.device.type != "cpu":
        raise ValueError(f"quantize_model reads a float32 model on the CPU, got {src.embed.weight.dtype} on "
                         f"{src.embed.weight.device}: pass source=, the same model built on the CPU in float32")
    if len(src.layers) != len(model.layers):
        raise ValueError(f"quantize_model: source has {len(src.layers)} layers, the model {len(model.layers)}")
    device = model.embed.weight.device
    for layer, src_layer in zip(model.layers, src.layers):
        for part, name in PROJECTIONS:
            w = _float_weight(getattr(getattr(src_layer, part), name))
            setattr(getattr(layer, part), name, QuantizedLinear(w, fmt).to(device))
    head = src.embed.weight if src.lm_head is None else src.lm_head.weight
    # the embedding keeps its rows; the head's copy is quantized
    model.quantized_head = QuantizedLinear(head, "int8_group", symmetric=True).to(device)
    model.packed_head = None  # the quantized head replaces it
    return model


def _float_weight(m: nn.Module) -> torch.Tensor:
    """The float32 weight of a projection: plain, packed for oneDNN, or quantized (dequantized)."""
    if isinstance(m, nn.Linear):
        return m.weight.detach()
    if hasattr(m, "dense"):  # model.PackedLinear, QuantizedLinear
        return m.dense()
    raise ValueError(f"quantize_model: a {type(m).__name__} is not a linear layer it can read")


def weight_bytes_per_step(model: nn.Module, streamed: bool = False) -> int:
    """Bytes of weights one decode step reads: every projection, norm and the LM head (quantized
    or not); the embedding rows a step looks up are left out (a few rows, not a matmul).

    Quantized layers count as stored (``QuantizedLinear.nbytes``), or with ``streamed`` as the
    CPU kernels read them (``read_nbytes``: float16 scales and minimums where those are exact).
    """
    def quantized(m: QuantizedLinear) -> int:
        return m.read_nbytes if streamed else m.nbytes

    total = 0
    for layer in model.layers:
        for part, name in PROJECTIONS:
            m = getattr(getattr(layer, part), name)
            total += quantized(m) if isinstance(m, QuantizedLinear) else m.weight.numel() * m.weight.element_size()
        for norm in (layer.input_norm, layer.post_attn_norm):
            total += norm.weight.numel() * norm.weight.element_size()
    if model.quantized_head is not None:
        total += quantized(model.quantized_head)
    else:
        w = model.embed.weight if model.lm_head is None else model.lm_head.weight
        total += w.numel() * w.element_size()
    return total
