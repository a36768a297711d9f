"""Chapter 0 exercises: the pieces of one Llama forward pass and one sampling step.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch00          # or: .venv/bin/python tests/grade.py ch00

Each docstring gives the shapes, the contract the tests check, and hints. Once you
have tried, compare with the file of ``minillm/`` named at the end of the docstring.
Plain PyTorch is all you need; do not import the answers from ``minillm``.
"""
from __future__ import annotations

from typing import Callable

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalization, as in every Llama layer.

    Shapes: x [..., D] (any number of leading dims), weight [D] -> [..., D].

    Contract:
      - y = x / sqrt(mean(x ** 2 over the last dim) + eps) * weight
      - the mean of squares is computed in float32 whatever x.dtype is: in float16,
        squares of values above ~256 overflow to inf;
      - the normalized x is cast back to x.dtype *before* it is multiplied by
        weight (the order transformers uses, so logits match bit for bit), and the
        result has x.dtype when weight has x.dtype.

    Hints: ``x.float()``, ``torch.rsqrt``, ``mean(-1, keepdim=True)``. No mean is
    subtracted: unlike LayerNorm, RMSNorm only rescales.

    In the engine: plugs into the seam ``rms_norm`` (``minillm/seams.py``), where it takes the
    place of every norm of the model's forward (the chapter's "Run it in the engine" cell).

    Answer, after you try: ``minillm/model.py``, ``rms_norm``.
    """
    raise NotImplementedError


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables of rotary position embeddings (RoPE).

    Shapes: positions [T] (integers; a flat batch, so they restart at 0 for each
    sequence) -> (cos [T, head_dim], sin [T, head_dim]), both float32.

    Contract ("rotate half" layout, the one transformers' Llama uses):
      - pair i (0 <= i < head_dim / 2) turns at frequency
        inv_freq[i] = 1 / theta ** (2 * i / head_dim);
      - angle[t, i] = positions[t] * inv_freq[i];
      - cos[t] = cos(angle[t]) repeated twice along the last dim, i.e. columns i
        and i + head_dim / 2 hold the same angle; sin likewise.

    Hints: ``torch.arange(0, head_dim, 2)``, an outer product of positions and
    inv_freq, ``torch.cat([freqs, freqs], dim=-1)``. Compute in float32.

    Answer, after you try: ``minillm/model.py``, ``rope_cos_sin``.
    """
    raise NotImplementedError


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by their position's angles.

    Shapes: x [T, H, D] (T tokens, H heads), cos and sin [T, D] from
    ``rope_cos_sin`` -> [T, H, D] in x.dtype.

    Contract: each pair (x[..., i], x[..., i + D/2]) is rotated by the angle of
    pair i:
        out[..., i]       = x[..., i] * cos - x[..., i + D/2] * sin
        out[..., i + D/2] = x[..., i + D/2] * cos + x[..., i] * sin
    The same rotation applies to every head. Position 0 leaves x unchanged, norms
    are preserved, and the dot product of a rotated query and key depends only on
    the distance between their positions -- that is why attention sees relative
    positions.

    Hints: write ``rotate_half(x) = cat([-x[..., D/2:], x[..., :D/2]])``, then
    ``x * cos + rotate_half(x) * sin``; broadcast cos over heads with
    ``cos[:, None, :]``. Pairs are (i, i + D/2), not neighbours (2i, 2i + 1).

    In the engine: plugs into the seam ``apply_rope`` (``minillm/seams.py``), where it rotates
    the queries and keys of every layer (H is then the query and key heads together).

    Answer, after you try: ``minillm/model.py``, ``apply_rope``.
    """
    raise NotImplementedError


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask every logit outside the top-k and outside the top-p nucleus with -inf.

    Shapes: logits [B, V] float (already divided by the temperature);
    top_k [B] integer, -1 = no top-k; top_p [B] float in (0, 1], 1.0 = no nucleus.
    Returns a new [B, V] tensor; the input is not modified.

    Contract, for each row b:
      1. top-k: keep the top_k[b] largest logits (all of them if top_k[b] is -1
         or >= V);
      2. top-p: over the softmax of the logits that survived step 1 (renormalized),
         keep the smallest set of most likely tokens whose probability sum reaches
         top_p[b]; equivalently, keep a token if the probability of all more likely
         tokens is still below top_p[b];
      3. kept logits keep their values, every other one becomes -inf; the most
         likely token is always kept.
    Rows are independent: each uses its own top_k[b] and top_p[b].

    Hints: sort each row once (``logits.sort(dim=-1, descending=True)``), build a
    mask in sorted order from ranks and from ``cumsum(probs) - probs``, then put
    the values back in vocabulary order with ``scatter`` (or ``gather`` with the
    inverse permutation). Avoid Python loops over the vocabulary.

    Answer, after you try: ``minillm/sampling.py``, ``apply_top_k_top_p``.
    """
    raise NotImplementedError


def sample_next_token(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> int:
    """Pick the next token from one row of logits.

    Shapes: logits [V] float -> a Python int in [0, V).

    Contract:
      - temperature == 0 is greedy: return argmax(logits), ignore top_k and top_p,
        and draw no random numbers (the generator's state is unchanged);
      - otherwise sample from softmax(filtered logits / temperature), where the
        filter is the top-k then top-p rule of ``apply_top_k_top_p``;
      - every random number comes from ``generator``, so the same seed gives the
        same tokens.

    Hints: divide by the temperature before filtering; reuse your
    ``apply_top_k_top_p`` on ``logits[None]``; ``torch.multinomial(probs, 1,
    generator=generator)`` draws one index.

    In the engine: plugs into the seam ``sample_next_token`` (``minillm/seams.py``), where it
    picks the next token of every row of a step, with the generator the engine seeds for that
    token's position.

    Answer, after you try: ``minillm/sampling.py``: ``compute_probs`` (the
    distribution), ``sample_from_probs`` (the draw) and ``sample`` (both, greedy
    rows skipped).
    """
    raise NotImplementedError


def decode_bytes_per_token(num_params: int, bytes_per_param: float, kv_bytes_per_token: int,
                           context_len: int, batch_size: int) -> float:
    """Napkin math: bytes read from memory per generated token during decode.

    Inputs:
      - ``num_params``: parameters of the model; ``bytes_per_param``: bytes each one
        takes in memory (4 in float32, 2 in bfloat16, about 0.5 when 4-bit quantized);
      - ``kv_bytes_per_token``: bytes of K and V that one token of context holds in the
        cache, every layer included (``ModelConfig.kv_bytes_per_token``);
      - ``context_len``: tokens already in each sequence's cache (all sequences alike);
      - ``batch_size``: sequences in the step (>= 1).

    Contract: one decode step produces one token for each of ``batch_size`` sequences.
    To do so the processor reads every weight once, whatever the batch size (each weight
    is loaded once and used for every sequence), and each sequence's own KV cache (its
    past, shared with nobody). Return the bytes that one step reads divided by the tokens
    it produces: a float, in bytes per generated token. Activations are small next to
    these and are ignored.

    Hints: count the bytes of one whole step first, then share them among the tokens it
    produced. Ask of each of the two kinds of bytes whether it grows with
    ``batch_size``. Check your function on its extremes: at batch 1 a token pays for
    every weight plus one sequence's cache; with a huge batch it pays for little more
    than its own cache.

    Use: divide the result by the memory bandwidth (bytes/s) to get a lower bound on
    the time per token (section 5 of the chapter measures the bandwidth).

    Example (SmolLM2-135M in bf16, ``minillm.ModelConfig``): num_params
    ~1.35e8, bytes_per_param 2, kv_bytes_per_token = 2 (K and V) * 30 layers
    * 3 KV heads * 64 dims * 2 bytes = 23040.

    Answer, after you try: ``solutions/ch00_the_model.py``.
    """
    raise NotImplementedError


def greedy_generate(forward: Callable[[list[int], int], torch.Tensor], prompt_ids: list[int],
                    max_new_tokens: int, eos_token_id: int) -> list[int]:
    """The decode loop: generate greedily with a KV-cached model. Returns the new tokens.

    ``forward(token_ids, start)`` feeds ``token_ids`` at positions start, start + 1, ...
    to the model, which appends their keys and values to its cache (so it must be called
    with start = the number of tokens fed so far), and returns their logits [n, vocab].

    Contract:
      - the first call feeds the whole prompt (start 0); every later call feeds only the
        one token generated last: never feed a token twice;
      - the next token is the argmax of the LAST row of the logits;
      - stop after ``max_new_tokens`` tokens, or right after emitting ``eos_token_id``
        (which is included in the result).

    Hints: keep a counter of tokens fed; ``int(logits[-1].argmax())``.

    Answer, after you try: ``solutions/ch00_the_model.py`` (the chapter prints it after
    its exercises), and ``minillm/engine.py``, ``LLMEngine.step``, which does the same for
    many requests at once.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch00")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
