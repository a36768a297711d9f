"""Speculative decoding: drafters propose tokens, the target verifies them exactly.

- ``rejection_sampler``: the verification rule (``rejection_sample``) and its pieces;
- ``ngram``: a drafter that copies continuations from the context (prompt lookup);
- ``exactness``: the test that speculative decoding leaves the target distribution
  unchanged (exact enumeration on toy models, and a sampling test);
- ``drafters``: the engine's drafters (n-gram, and a model with its own KV cache);
- ``verify``: the engine step -- propose, one verifying forward, rejection sampling,
  roll-back of rejected tokens' KV -- and the counters (``SpecStats``);
- ``policy``: adaptive k, the off switch under load, the speedup model;
- ``prompts``, ``measure``: the grounded / open workloads and timing helpers of chapter 5.
"""
from .ngram import NgramProposer
from .rejection_sampler import (
    acceptance_probability,
    acceptance_rate,
    draft_probs_from_logits,
    emit_tokens,
    expected_num_emitted,
    rejection_sample,
    rejection_sample_ref,
    residual_distribution,
    target_probs_from_logits,
    verify_probs,
)

__all__ = [
    "NgramProposer",
    "acceptance_probability",
    "acceptance_rate",
    "draft_probs_from_logits",
    "emit_tokens",
    "expected_num_emitted",
    "rejection_sample",
    "rejection_sample_ref",
    "residual_distribution",
    "target_probs_from_logits",
    "verify_probs",
]
