"""Our Llama forward equals transformers' LlamaForCausalLM loaded from the same GGUF."""
import copy

import pytest
import torch

from minillm import SamplingParams
from minillm.model_runner import prompt_logits
from tests.prompts import SHORT, long_prompt

pytestmark = pytest.mark.slow
ATOL = 1e-3  # fp32 on the CPU; measured max diffs are ~5e-5 (short) to ~1e-4 (1k tokens)


def hf_logits(hf_model, ids):
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("i", range(len(SHORT)))
def test_logits_match_transformers_short(real_llm, hf_model, tokenizer, i):
    ids = tokenizer(SHORT[i]).input_ids
    ours = prompt_logits(real_llm.engine.model, ids)
    ref = hf_logits(hf_model, ids)
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"prompt {i}: max |logit diff| {diff:.2e} > {ATOL}"


def test_logits_match_transformers_long_prompt(real_llm, hf_model, tokenizer):
    ids = long_prompt(tokenizer, 1000)
    assert len(ids) >= 1000
    ours = prompt_logits(real_llm.engine.model, ids)
    ref = hf_logits(hf_model, ids)
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"{len(ids)}-token prompt: max |logit diff| {diff:.2e} > {ATOL}"


def test_chunked_prefill_equals_whole_prompt(real_llm, tokenizer):
    # Feeding a prompt in chunks that end mid-block attends to the cached context exactly
    # as feeding it whole does: the path chunked prefill and verification build on.
    ids = long_prompt(tokenizer, 300)[:300]
    whole = prompt_logits(real_llm.engine.model, ids)
    for chunk in (37, 128):
        chunked = prompt_logits(real_llm.engine.model, ids, chunk_size=chunk, block_size=16)
        torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


def _first_near_tie(hf_model, ids, ref_new, margin=1e-3):
    """Index of the first generated position whose top-2 logits are within ``margin``."""
    full = hf_logits(hf_model, ids + ref_new)
    top2 = full[len(ids) - 1:-1].topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    return next((j for j, g in enumerate(gaps) if g < margin), None)


@pytest.mark.parametrize("prompt", SHORT[:4])
def test_greedy_64_tokens_equal_transformers_generate(real_llm, hf_model, tokenizer, prompt):
    ids = tokenizer(prompt).input_ids
    # No EOS for transformers either (min_new_tokens would instead *mask* EOS, a different
    # distribution); both sides then produce exactly 64 greedy tokens.
    # An empty EOS list is how transformers is told "never stop early".
    gen_cfg = copy.deepcopy(hf_model.generation_config)
    gen_cfg.update(eos_token_id=[], pad_token_id=tokenizer.eos_token_id, max_new_tokens=64, do_sample=False)
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), generation_config=gen_cfg)[0, len(ids):].tolist()
    assert len(ref) == 64
    out = real_llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0].token_ids
    if out != ref:
        j = next(k for k, (a, b) in enumerate(zip(out, ref)) if a != b)
        tie = _first_near_tie(hf_model, ids, ref)
        # The only excuse for a difference is a genuine near-tie at or before the first mismatch.
        assert tie is not None and tie <= j, f"first mismatch at token {j} without a near-tie: {out[j]} vs {ref[j]}"
        pytest.skip(f"near-tie (top-2 logits within 1e-3) at generated token {tie}; equal before it")
    assert len(out) == 64
