"""Chapter 11 exercises: weights in fewer bits, the floor they set, and a GEMV that reads them.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch11          # or: .venv/bin/python tests/grade.py ch11

Each docstring gives the contract the tests check and hints. Once you have tried,
compare with the file of ``minillm/`` named at the end of the docstring. PyTorch (and
Triton for the last function) is all you need; do not import the answers from ``minillm``.

Three functions are also seams of the library (``minillm/seams.py``): plugged in, yours
quantize every projection of ``LLM(quantization="int8" | "q4")``, dequantize them, and
multiply every 8-bit layer by the activations. The chapter's "Run it in the engine" cells
do it and check that the model's tokens are the library's.
"""
from __future__ import annotations

import torch


def quantize_groups(weight: torch.Tensor, bits: int, group_size: int = 32
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight matrix in groups along its rows: asymmetric, ``bits`` bits a code.

    Shapes: weight float32 [N, K] with K a multiple of ``group_size``. Group g of row n holds
    columns ``g * group_size .. (g + 1) * group_size - 1``.

    Returns ``(codes, scales, mins)``:
      - ``codes`` uint8 [N, K], each in ``[0, 2**bits - 1]`` (one code a byte here; packing
        two 4-bit codes into a byte is the library's business);
      - ``scales`` and ``mins`` float32 [N, K // group_size], one of each per group;
      - a group stands for ``codes * scale + min``: its ``min`` is the group's smallest weight,
        its ``scale`` is ``(max - min) / (2**bits - 1)``, and a weight's code is the nearest
        grid point, ``round((w - min) / scale)`` (``torch.round``), clamped to the range;
      - a constant group (max == min) gets scale 1.0 and every code 0 (so it dequantizes to
        its value exactly, and nothing divides by zero);
      - every weight dequantizes to within ``scale / 2`` of itself (the grader checks it, and
        that the codes are the nearest ones);
      - ``bits`` not 4 or 8, ``group_size < 1``, or K not a multiple of it -> ``ValueError``.

    Example: at 4 bits, one group [-1.0, 0.0, 0.5, 14.0] has min -1, scale 15 / 15 = 1 and
    codes [0, 1, 2, 15] (0.5 is 1.5 steps above min: torch.round rounds the tie to the even 2).

    Hints: ``weight.reshape(N, K // group_size, group_size)``; ``amin``/``amax`` over the last
    dimension; ``torch.where`` for the constant groups; ``.clamp(0, top).to(torch.uint8)``.

    In the engine: the seam ``quantize_groups``. ``LLM(quantization=...)`` calls it for every
    projection of every layer (the LM head keeps the library's symmetric 8-bit groups).

    Answer, after you try: ``minillm/quantization.py``, ``quantize_groups``.
    """
    raise NotImplementedError


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that ``(codes, scales, mins)`` stands for.

    Shapes: codes uint8 [N, K]; scales, mins float32 [N, K // G] (G, the group size, is
    K divided by the number of groups). Element (n, k) is ``codes[n, k] * scale + min`` of
    its group ``k // G``, computed in float32 as written (multiply, then add).

    Contract: exact, element for element, against that formula; shapes that do not fit
    (scales and mins of different shapes, another N, K not a multiple of the groups)
    -> ``ValueError``.

    In the engine: the seam ``dequantize_groups``. Plugged in, every quantized layer
    dequantizes its weight with yours and multiplies it with ``torch.nn.functional.linear``
    (in place of the library's fused CPU kernel, which never writes the weight out).

    Answer, after you try: ``minillm/quantization.py``, ``dequantize_groups``.
    """
    raise NotImplementedError


def decode_floor_ms(num_weights: int, bits: int, group_size: int | None, bandwidth_gbps: float) -> float:
    """The least time (milliseconds) one decode step can take: reading every weight once.

    ``num_weights`` weights stored in ``bits`` bits each; when ``group_size`` is not None,
    every group of ``group_size`` weights also stores a float32 scale and a float32 minimum
    (8 bytes a group); None: no groups (plain float32 is ``bits=32, group_size=None``,
    bfloat16 ``bits=16, group_size=None``). ``bandwidth_gbps`` is the memory's read speed
    in GB/s (1 GB = 10**9 bytes).

    Contract: bytes / (bandwidth_gbps * 1e9), in milliseconds, within 1e-9 relative;
    ``num_weights < 1``, ``bits`` not one of 4, 8, 16, 32, ``group_size < 1``, or
    ``bandwidth_gbps <= 0`` -> ``ValueError``. The number of groups is
    ``ceil(num_weights / group_size)`` (a last, partial group still stores its pair).

    The chapter draws its floors with yours and checks them against the bytes the
    library's quantized models hold.

    Answer, after you try: ``minillm/quantization.py``, ``bits_per_weight`` and
    ``weight_bytes_per_step`` (and chapter 0's floor).
    """
    raise NotImplementedError


def int8_gemv_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     group_size: int = 32) -> torch.Tensor:
    """y = x @ w.T with w dequantized from 8-bit groups inside a Triton kernel you write.

    Shapes: x float32 [M, K] (M >= 1, contiguous); codes uint8 [N, K]; scales and mins
    float32 [N, K // group_size]. Returns y float32 [M, N] with
    ``y[m, n] = sum_k x[m, k] * (codes[n, k] * scales[n, k // G] + mins[n, k // G])``.

    Contract: a ``@triton.jit`` kernel (define it at module level, above this function),
    launched here over blocks of output columns (e.g. grid ``(M, cdiv(N, BLOCK_N))``), that
    loads codes, scales and minimums and never writes the dequantized weight to memory;
    float32 accumulation; within 1e-4 (relative to the largest |y|) of a PyTorch oracle. The
    tests run it under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, set by the
    test setup), with N not a multiple of your block (mask the edges).

    Hints: one program per (row m, block of BLOCK_N outputs); loop over K in steps of
    BLOCK_K (a multiple of ``group_size``, e.g. 64 or 128); for a [BLOCK_N, BLOCK_K] tile,
    the group of column k is ``k // group_size``, so ``scales`` is read at
    ``n * (K // group_size) + k // group_size``; ``w = codes.to(tl.float32) * s + mn``;
    ``acc += tl.sum(w * x[None, :], axis=1)``. In the interpreter big blocks are fast (it
    pays per program and per operation): BLOCK_N 256 and BLOCK_K 128 are fine. Import
    triton inside this file.

    In the engine: the seam ``int8_gemv_triton``. Plugged in, it multiplies every 8-bit
    group layer (``quantization="int8"``: the projections and the LM head); on the CPU
    that runs in the interpreter, so the chapter runs it for a few tokens only.

    Answer, after you try: ``minillm/kernels/quant_gemv.py``, ``u8_gemv``.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch11")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
