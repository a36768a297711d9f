"""The elementwise work between a layer's matmuls as C++ calls (``layer_ops.cpp``).

``model.Llama`` runs its layers through these when the attention backend is ``cpu``
(``Llama.forward``): per layer, four matmuls (oneDNN, as before) and four calls here --
RoPE with the K/V cache write, the step's attention rows (``attention.py``), the
residual add with the next RMSNorm, and silu(gate) * up -- instead of some forty small
PyTorch ops. Each function computes what model.py's ops compute, rounded at the same
points (see the .cpp); the tests hold them to it.

The functions check what would make the C++ read or write out of bounds (dtype, shape,
contiguity, slots) and raise ValueError; they are built with the attention kernel, into
the same library (``build.library``).
"""
from __future__ import annotations

import torch

from .build import DTYPE_CODES, library, named_call

# profiler names of the layer ops (python -m minillm.bench.profile_step counts them in "other ops")
NORM, SILU, ROPE = "minillm::cpu_add_rms_norm", "minillm::cpu_silu_mul", "minillm::cpu_rope_write"


def _check(*tensors: torch.Tensor) -> int:
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or dtype not in DTYPE_CODES:
            raise ValueError(f"the CPU layer ops take float32 or bfloat16 tensors of one dtype, got "
                             f"{', '.join(str(x.dtype) for x in tensors)}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the CPU layer ops take contiguous CPU tensors")
    return DTYPE_CODES[dtype]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, n): h = x + residual (x itself when residual is None), n = model.rms_norm(h, weight, eps).

    x, residual: [T, D]; weight: [D].
    """
    T, D = x.shape
    code = _check(x, weight) if residual is None else _check(x, residual, weight)
    if weight.shape != (D,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}, weight {tuple(weight.shape)}")
    h = x if residual is None else torch.empty_like(x)
    n = torch.empty_like(x)
    named_call(NORM, library().minillm_add_rms_norm, code, x.data_ptr(),
               None if residual is None else residual.data_ptr(), h.data_ptr(), n.data_ptr(), weight.data_ptr(),
               T, D, eps, torch.get_num_threads())
    return h, n


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2F] = [gate | up] -> [T, F] (model.MLP)."""
    T, F2 = gate_up.shape
    code = _check(gate_up)
    if F2 % 2:
        raise ValueError(f"silu_mul takes [T, 2F], got {tuple(gate_up.shape)}")
    out = gate_up.new_empty((T, F2 // 2))
    named_call(SILU, library().minillm_silu_mul, code, gate_up.data_ptr(), out.data_ptr(), T, F2 // 2,
               torch.get_num_threads())
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotated queries [T, Hq, D]; the rotated keys and the values written to the caches.

    qkv: [T, (Hq + 2 Hkv) D], the fused projection's output (model.Attention); cos, sin:
    [T, D] in qkv's dtype; slot_mapping [T] int64; caches [num_blocks, block_size, Hkv, D].
    The same numbers as model.apply_rope followed by attention.write_kv.
    """
    T = qkv.shape[0]
    _, block_size, Hkv, D = k_cache.shape
    code = _check(qkv, cos, sin, k_cache, v_cache)
    if (qkv.shape[1] != (num_heads + 2 * Hkv) * D or cos.shape != (T, D) or sin.shape != (T, D)
            or v_cache.shape != k_cache.shape or slot_mapping.shape != (T,) or D % 2):
        raise ValueError(f"rope_write: qkv {tuple(qkv.shape)} with {num_heads} query heads, cos/sin "
                         f"{tuple(cos.shape)}/{tuple(sin.shape)}, slots {tuple(slot_mapping.shape)}, caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous int64 tensor")
    q = qkv.new_empty((T, num_heads, D))
    rc = named_call(ROPE, library().minillm_rope_write, code, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                    slot_mapping.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    k_cache.shape[0] * block_size, T, num_heads, Hkv, D, torch.get_num_threads())
    if rc == 6:
        raise ValueError(f"rope_write: a slot is outside the cache's {k_cache.shape[0] * block_size} slots")
    return q


class ForwardOps:
    """The layer ops of one forward, for ``model.Llama._cpu_layers``: everything that is the same
    in every layer (dtype, token count, thread count, RoPE rows, slots, every layer's caches, the
    step's attention rows) is checked and bound once, and a layer's call passes only its own
    pointers. The functions above check every call, which costs microseconds each: 150 calls a
    step at SmolLM2's size.

    Buffers are reused across layers: the residual stream ``h`` is updated in place (h += x),
    the normed rows, the rotated queries, the attention output and silu's output each live in
    one buffer that the next layer overwrites after its matmul has read it.
    """

    def __init__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, num_heads: int,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], intermediate_size: int, rows):
        T, hidden = h.shape
        k_cache = kv_caches[0][0]
        self.code = _check(h, cos, sin, k_cache)
        _, block_size, Hkv, D = k_cache.shape
        slots = meta.slot_mapping
        if cos.shape != (T, D) or sin.shape != (T, D) or slots.shape != (T,) or slots.dtype != torch.int64 \
                or not slots.is_contiguous():
            raise ValueError(f"ForwardOps: cos/sin {tuple(cos.shape)}, slots {tuple(slots.shape)} {slots.dtype} "
                             f"for {T} tokens of head_dim {D}")
        for c in (c for kv in kv_caches for c in kv):
            if c.shape != k_cache.shape or c.dtype != k_cache.dtype or c.device.type != "cpu" or not c.is_contiguous():
                raise ValueError(f"every layer's caches must be contiguous CPU {tuple(k_cache.shape)} {k_cache.dtype}")
        self.kv_ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        self.lib = library()
        self.T, self.hidden, self.F = T, hidden, intermediate_size
        self.Hq, self.Hkv, self.D = num_heads, Hkv, D
        self.dtype = k_cache.dtype
        self.threads = torch.get_num_threads()
        self.n = torch.empty_like(h)
        self.q = h.new_empty((T, num_heads, D))
        self.o = torch.empty_like(self.q)
        self.act = h.new_empty((T, intermediate_size))
        self.rope_args = (cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), self.q.data_ptr())
        self.num_slots = k_cache.shape[0] * block_size
        self.rows = rows  # attention.AttentionRows of the step's queries, or None (attention elsewhere)
        if rows is not None:
            self.attend_args = rows.bind(self.q, self.o, k_cache)

    def _rows(self, t: torch.Tensor, width: int) -> int:
        # a matmul's output: [T, width] contiguous, in the step's dtype
        if t.shape != (self.T, width) or t.dtype != self.dtype or not t.is_contiguous():
            raise ValueError(f"expected a contiguous [{self.T}, {width}] {self.dtype} tensor, got "
                             f"{tuple(t.shape)} {t.dtype}")
        return t.data_ptr()

    def add_norm(self, x: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h += x (in place; x None: no add), then the normed rows of h (a buffer the next call reuses)."""
        hp = self._rows(h, self.hidden)
        xp = hp if x is None else self._rows(x, self.hidden)
        named_call(NORM, self.lib.minillm_add_rms_norm, self.code, xp, None if x is None else hp, hp,
                   self.n.data_ptr(), weight.data_ptr(), self.T, self.hidden, eps, self.threads)
        return self.n

    def rope_write(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        """``rope_write`` into the step's query buffer and layer ``layer``'s caches."""
        xp = self._rows(qkv, (self.Hq + 2 * self.Hkv) * self.D)
        cp, sp, slots, qp = self.rope_args
        rc = named_call(ROPE, self.lib.minillm_rope_write, self.code, xp, cp, sp, slots, qp, *self.kv_ptrs[layer],
                        self.num_slots, self.T, self.Hq, self.Hkv, self.D, self.threads)
        if rc == 6:
            raise ValueError(f"rope_write: a slot is outside the cache's {self.num_slots} slots")
        return self.q

    def attend(self, layer: int, scale: float) -> torch.Tensor:
        """The step's attention (the CPU kernel, every query a row) over layer ``layer``'s caches,
        from the query buffer into the output buffer."""
        if self.rows is None:
            raise ValueError("ForwardOps was made without the step's rows: attention runs elsewhere")
        self.rows.run(self.attend_args, *self.kv_ptrs[layer], scale)
        return self.o

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gp = self._rows(gate_up, 2 * self.F)
        named_call(SILU, self.lib.minillm_silu_mul, self.code, gp, self.act.data_ptr(), self.T, self.F, self.threads)
        return self.act
