"""Speculative decoding: drafters propose tokens, the target verifies them exactly.

- ``rejection_sampler``: the verification rule (``rejection_sample``) and its pieces;
- ``ngram``: a drafter that copies continuations from the context (prompt lookup);
- ``drafters``: the engine's drafters (n-gram, and a model with its own KV cache);
- ``speculator``: the engine's side -- propose drafts in the lookahead the scheduler
  reserved, verify them after the one forward -- and the counters (``SpecStats``);
- ``medusa``: Medusa heads, the target's own drafters on its last hidden state (trained
  by ``minillm.bench.train_medusa``); the engine's drafter is ``drafters.MedusaDrafter``;
- ``tree``: candidate trees -- their shape, attention mask and positions, and the rules
  that verify them (exact multi-candidate rejection sampling, Medusa-2's typical acceptance);
- ``policy``: the speculation policy -- adaptive k, the off switch under load, the
  speedup model (plain Python: the scheduler reads it).

The exactness test and the timing helpers of chapter 5 are measuring tools:
``minillm.bench.exactness`` and ``minillm.bench.spec_measure``.

Submodules are imported on first use, so the torch-free ``policy`` can be read by the
scheduler without importing torch.
"""
import importlib

_EXPORTS = {
    "NgramProposer": "ngram",
    **{name: "rejection_sampler" for name in (
        "acceptance_probability", "acceptance_rate", "draft_probs_from_logits", "emit_tokens",
        "expected_num_emitted", "rejection_sample", "rejection_sample_ref", "residual_distribution",
        "target_probs_from_logits", "verify_probs")},
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
