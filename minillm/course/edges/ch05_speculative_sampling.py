"""Chapter 5's edges: drafts rejected at a block edge, two blocks of drafts given back at once,
seeded sampling judged by the rule, a suffix that occurs more than once, adaptive k at its
thresholds and its bounds.

Speculative decoding needs a forward, so each case runs the paged engine on a tiny random
Llama (vocabulary 64, three layers: a few hundred milliseconds a run) with prompt lookup
drafting, and compares what the engine decided step by step: the drafts it fed, the rows
and tokens of every step, every request's block table after it, and the output tokens.

The rule in the engine. Prompt lookup is deterministic, so q is the one-hot of each draft,
and a plugged ``rejection_sample_one`` is judged with u_i = exp(-E_i[x_i]), E the noise of
the draft's position (``rejection_sampler.per_row_verifier``). Greedy rows then emit the
library's tokens exactly. With sampling they emit an exact sample of the target, but not the
one the library's own verifier (the coupled race, ``coupled_verify``) draws, so the sampling
case gives the library's side the same one-request walk, built from ``verify_probs``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch

from minillm import seams
from minillm.sampling_params import SamplingParams

from . import EdgeCase
from ._engine import schedule

_TINY: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                             num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_id=2)
_weights: dict[str, torch.Tensor] = {}


def _tiny_weights() -> dict[str, torch.Tensor]:
    """Seeded random weights, scaled so greedy text neither repeats one token nor looks like
    noise: prompt lookup then gets both accepted and rejected drafts."""
    if not _weights:
        from minillm import loader
        from minillm.config import ModelConfig

        raw = loader.dummy_weights(ModelConfig(**_TINY), 0)
        _weights.update({k: v if "norm" in k else v * 10.0 for k, v in raw.items()})
    return _weights


def _library_rule(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                  uniforms: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The library's rule for one request, with the uniforms it is given (the exercise's signature)."""
    from minillm.spec_decode.rejection_sampler import verify_probs

    ids = torch.tensor(draft_tokens, dtype=torch.long).reshape(1, -1)
    accept, emit = verify_probs(ids, q[None], p[None])
    n = 0
    while n < len(draft_tokens) and uniforms[n] < accept[0, n]:
        n += 1
    return list(draft_tokens[:n]), emit[0, n]


def _run(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], spec: dict[str, Any],
         temperature: float = 0.0, judged_by_rule: bool = False, **options: Any) -> dict[str, Any]:
    """The engine on ``prompts`` with prompt lookup: what it drafted, scheduled, held and emitted."""
    from minillm.config import EngineConfig, ModelConfig
    from minillm.engine import build_engine
    from minillm.spec_decode.rejection_sampler import per_row_verifier

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest and never waits on busy workers
    try:
        config = EngineConfig(**(dict(engine="paged", device="cpu", dtype="float32", max_model_len=128,
                                      attention_backend="torch") | options),
                              speculative=dict(method="ngram", disable_by_batch_size=None) | spec)
        engine = build_engine(config, weights=_tiny_weights(), tokenizer=None, model_config=ModelConfig(**_TINY))
        if judged_by_rule and seams.plugged("rejection_sample_one") is None:
            engine.speculator.verifier = per_row_verifier(_library_rule)
        drafts: list[list[tuple[str, tuple[int, ...]]]] = []
        propose = engine.speculator.propose

        def recorded(out):
            n = propose(out)
            drafts.append([(row.request.request_id, tuple(row.spec_token_ids)) for row in out.rows if row.max_drafts])
            return n

        engine.speculator.propose = recorded
        requests = [engine.add_request(list(p), SamplingParams(temperature=temperature, max_tokens=m, seed=i,
                                                               ignore_eos=True), request_id=str(i))
                    for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        tables = []
        while engine.has_unfinished():
            engine.step()
            tables.append({r.request_id: tuple(r.block_ids) for r in requests if not r.is_finished})
        return {"drafts": drafts, "schedule": schedule(engine.step_records), "block tables": tables,
                "preemptions": [r.metrics.num_preemptions for r in requests],
                "tokens": [r.output_token_ids for r in requests]}
    finally:
        torch.set_num_threads(threads)


def _motif_prompts(n: int, seed: int) -> list[list[int]]:
    """Short prompts with a repeated motif, so prompt lookup has something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(3, _TINY["vocab_size"], (3 + i,), generator=g).tolist()
        out.append(motif * 2 + torch.randint(3, _TINY["vocab_size"], (2,), generator=g).tolist())
    return out


_CHAIN = ("rejection_sample_one", "ngram_propose", "rollback_blocks")  # what every speculative step runs

CASES = [
    # k = 4 drafts over blocks of 2 tokens: a full lookahead takes two blocks past those of the
    # tokens the request already has, and a rejection gives back one or two of them, with the kept
    # tokens ending on a block edge or inside a block. 28 blocks for 4 requests: some lookaheads
    # are cut short by the free blocks, and two requests are preempted.
    EdgeCase("greedy, 4 drafts over blocks of 2: drafts rejected at a block edge and inside one, two blocks "
             "given back at once, lookaheads cut by the free blocks, preemption",
             _CHAIN, partial(_run, _motif_prompts(4, 0), [20, 16, 24, 12],
                             dict(num_speculative_tokens=4, prompt_lookup_min=1),
                             block_size=2, num_blocks=28, max_model_len=48, max_num_seqs=4)),
    # Drafts accepted, rejected (the target gives them probability > 0: the residual must drop
    # them), all accepted (the bonus token), with the noise of each position fixing the outcome.
    EdgeCase("seeded sampling at temperature 0.5, each draft judged by the rule with the engine's uniforms",
             _CHAIN, partial(_run, _motif_prompts(4, 2), [24, 24, 24, 24],
                             dict(num_speculative_tokens=3, prompt_lookup_min=1),
                             temperature=0.5, judged_by_rule=True, block_size=4, max_num_seqs=4)),
    # Suffixes of 3, then 2 tokens (n = 1 never): a repeated token whose most recent occurrence
    # overlaps the suffix, several earlier occurrences, a lookahead cut to one draft by max_tokens.
    EdgeCase("default prompt lookup (n = 3, then 2), 6 requests on 3 slots: a suffix that overlaps its most "
             "recent occurrence, a lookahead cut short by max_tokens",
             _CHAIN, partial(_run, _motif_prompts(6, 4), [16, 24, 12, 20, 16, 24], dict(num_speculative_tokens=4),
                             block_size=4, max_num_seqs=3)),
    # Recent acceptance exactly 0.8 at k = 3 and exactly 0.5 at k = 3 and 4 (k must stay), above
    # 0.8 at k_max = 4 (k stays at k_max) and below 0.5 at k = 1 (k stays at 1).
    EdgeCase("adaptive k: recent acceptance exactly at the thresholds 0.8 and 0.5; k held at 1 and at k_max = 4",
             _CHAIN + ("next_num_speculative_tokens",),
             partial(_run, _motif_prompts(4, 2), [32, 32, 32, 32],
                     dict(num_speculative_tokens=4, adaptive=True, prompt_lookup_min=1), block_size=4, max_num_seqs=4)),
]
