"""Chapter 10 exercises: beyond one device, tensor parallelism Megatron-style.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch10          # or: .venv/bin/python tests/grade.py ch10

Each docstring gives the contract the tests check and hints. Once you have tried,
compare with the file of ``minillm/`` named at the end of the docstring. PyTorch is all
you need; do not import the answers from ``minillm``.

N ranks (devices) each hold a slice of every projection. Column-parallel layers (q, k, v,
gate, up) split their output features, so each rank computes whole features of its own;
row-parallel layers (o, down) split their input features, so each rank computes a partial
sum of the whole output, and one all-reduce (the elementwise sum over ranks) completes
it: two all-reduces a layer, one after attention and one after the MLP.

The three functions are also seams of the library (``minillm/seams.py``): plugged in, yours
cut every rank's weights of ``LLM(tensor_parallel_size=N)``, run every rank's MLP, and give
the bytes the tensor-parallel runner reports next to the bytes it counted.
"""
from __future__ import annotations

from typing import Callable

import torch


def shard_linear(weight: torch.Tensor, sizes: list[int], rank: int, parallel: str) -> torch.Tensor:
    """This rank's slice of an ``nn.Linear`` weight, cut for column or row parallelism.

    Shapes: weight [out_features, in_features] (any dtype; the slice keeps it). The split
    dimension is cut into consecutive pieces, ``sizes[r]`` for rank r, with
    ``start = sum(sizes[:rank])``:
      - ``parallel="column"``: this rank's OUTPUT features, the rows
        ``weight[start:start + sizes[rank]]`` -> [sizes[rank], in_features];
      - ``parallel="row"``: this rank's INPUT features, the columns
        ``weight[:, start:start + sizes[rank]]`` -> [out_features, sizes[rank]].

    The pieces need not be equal: SmolLM2-135M has 3 KV heads of 64, so 2 ranks get 2 heads
    and 1 (k_proj's 192 rows cut as ``sizes=[128, 64]``); a piece may be 0.

    Contract: exactly those elements, in that order, as a contiguous copy with storage of
    its own (the rank keeps its slice, not the whole matrix); the pieces of all ranks put
    back together (``torch.cat`` along the split dimension) are the weight. ``ValueError``,
    saying what to change, for: ``parallel`` not "column" or "row"; a weight that is not
    2-D; ``sum(sizes)`` not equal to the split dimension; a size < 0; ``rank`` outside
    ``[0, len(sizes))``.

    Example: weight = torch.arange(12.).reshape(4, 3), sizes=[3, 1]:
      rank 1, "column" -> [[9., 10., 11.]]; with sizes=[2, 1], rank 0, "row" ->
      [[0., 1.], [3., 4.], [6., 7.], [9., 10.]].

    Hints: a slice of rows is already contiguous, so ``.contiguous()`` alone would hand back
    a view that keeps the whole matrix alive: ``.clone()`` it (``.contiguous()`` then
    ``.clone()`` is safe for both). Check the arguments before slicing: Python slices past
    the end quietly.

    In the engine: the seam ``shard_linear``. ``LLM(tensor_parallel_size=N)`` calls it to cut
    every rank's weights when it builds its workers (q, k, v, gate and up by column, o and
    down by row).

    Answer, after you try: ``minillm/distributed/sharding.py``, ``shard_linear``.
    """
    raise NotImplementedError


def parallel_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One rank's share of the SwiGLU MLP, and the one all-reduce that completes it.

    Shapes: x [T, hidden], the full activations (the same on every rank); gate_up
    [2 * I_r, hidden], this rank's I_r gate rows followed by its I_r up rows
    (column-parallel); down [hidden, I_r], this rank's I_r input columns of the down
    projection (row-parallel). Returns [T, hidden], the full MLP output (the same on every
    rank).

    Compute ``gate, up = F.linear(x, gate_up).chunk(2, dim=-1)``, then the partial output
    ``partial = F.linear(F.silu(gate) * up, down)`` and return ``all_reduce(partial)``.
    ``all_reduce(t)`` returns the elementwise sum of ``t`` over all ranks (a new tensor, or
    ``t`` summed in place and returned): use what it returns.

    Contract: exactly ONE ``all_reduce`` call, after the down projection; every rank's result
    equals the unsharded MLP ``F.linear(F.silu(x @ Wg.T) * (x @ Wu.T), Wd)`` (float32, within
    about 1e-5). The grader runs N ranks as N threads (N = 1 to 4, equal and unequal I_r)
    whose ``all_reduce`` meets at a barrier, sums and counts the calls.

    Example: with one rank, ``all_reduce`` returns its argument and the answer is the plain
    MLP of the whole weights.

    Hints: SiLU and the product are elementwise, so each rank applies them to its own
    intermediate features without talking to the others; only the down projection mixes
    features, and the sum over ranks of ``F.linear(h_r, Wd_r)`` is ``F.linear(h, Wd)``.
    Summing after ``gate_up`` instead would add different ranks' features together.

    In the engine: the seam ``parallel_mlp``, every rank's MLP in the engine's workers.

    Answer, after you try: ``minillm/distributed/sharding.py``, ``parallel_mlp``.
    """
    raise NotImplementedError


def allreduce_bytes_per_step(num_layers: int, hidden_size: int, num_tokens: int, dtype_bytes: int) -> int:
    """The bytes each rank all-reduces in one forward of ``num_tokens`` tokens.

    Two all-reduces a layer (after the attention output projection and after the MLP's down
    projection), each of ``num_tokens x hidden_size`` elements of ``dtype_bytes`` bytes:
    ``2 * num_layers * hidden_size * num_tokens * dtype_bytes``. (The number of ranks is not
    in it: each rank sums a tensor of the whole output's size, however many ranks there are.)

    Contract: that number, as an ``int``. ``ValueError`` for an argument that is negative or
    not an ``int`` (a float such as 8.0 and a bool are not ints here), or ``dtype_bytes`` not
    one of 1, 2, 4, 8. Zero tokens or layers are fine: 0 bytes.

    Example: SmolLM2-135M (30 layers, hidden 576), a decode step of 8 tokens in float32:
    2 * 30 * 576 * 8 * 4 = 1,105,920 bytes.

    Hints: ``isinstance(True, int)`` is True in Python: test ``bool`` first.

    In the engine: the seam ``allreduce_bytes_per_step``, the formula the engine's
    tensor-parallel runner reports next to the bytes it counted.

    Answer, after you try: ``minillm/distributed/sharding.py``, ``allreduce_bytes_per_step``.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch10")``. A choice
    question takes a letter ("b"); a numeric question a number (rounded as the question
    says before it is compared). Leave a question out until you have an answer: it is
    graded as not answered.
    """
    raise NotImplementedError
