"""Wrong answers to exercises/ch04_chunked_prefill.py, each a mistake the contract rules out."""
from __future__ import annotations

import torch

from mutants import mutant
from solutions import ch04_chunked_prefill as ref


def _check_budget(num_decodes, budget):
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    if num_decodes > budget:
        raise ValueError(f"{num_decodes} decodes do not fit the budget {budget}")


# ---------------------------------------------------------------- split_budget


@mutant("split_budget", "the decodes' tokens are not charged: the prompts share the whole budget")
def _split_decodes_uncharged(num_decodes, prefill_tokens_left, budget):
    _check_budget(num_decodes, budget)
    left, chunks = budget, []
    for n in prefill_tokens_left:
        chunks.append(min(n, left))
        left -= chunks[-1]
    return chunks


@mutant("split_budget", "a prompt that does not fit what is left waits whole (no chunk), and so does the rest")
def _split_no_partial_chunk(num_decodes, prefill_tokens_left, budget):
    _check_budget(num_decodes, budget)
    left, chunks = budget - num_decodes, []
    for n in prefill_tokens_left:
        take = n if n <= left else 0
        if take == 0:
            left = 0  # first come, first served: nobody after it
        chunks.append(take)
        left -= take
    return chunks


@mutant("split_budget", "a prompt that does not fit is skipped; shorter ones behind it take the budget")
def _split_first_fit(num_decodes, prefill_tokens_left, budget):
    _check_budget(num_decodes, budget)
    left, chunks = budget - num_decodes, []
    for n in prefill_tokens_left:
        take = n if n <= left else 0
        chunks.append(take)
        left -= take
    return chunks


@mutant("split_budget", "decodes that fill the budget exactly are rejected (num_decodes >= budget raises)")
def _split_exact_decodes_rejected(num_decodes, prefill_tokens_left, budget):
    if budget < 1 or num_decodes >= budget:
        raise ValueError(f"{num_decodes} decodes leave nothing of the budget {budget}")
    return ref.split_budget(num_decodes, prefill_tokens_left, budget)


@mutant("split_budget", "what is left is shared evenly between the prompts, not given in arrival order")
def _split_even(num_decodes, prefill_tokens_left, budget):
    _check_budget(num_decodes, budget)
    chunks = [0] * len(prefill_tokens_left)
    left = budget - num_decodes
    waiting = [i for i, n in enumerate(prefill_tokens_left) if n > 0]
    while left > 0 and waiting:
        share = max(left // len(waiting), 1)
        for i in list(waiting):
            take = min(share, prefill_tokens_left[i] - chunks[i], left)
            chunks[i] += take
            left -= take
            if chunks[i] == prefill_tokens_left[i]:
                waiting.remove(i)
    return chunks


@mutant("split_budget", "the input list is turned into the answer in place (it is modified)",
        same_in_engine="the scheduler hands split_budget a copy of its list (PagedScheduler._planned_chunks)")
def _split_in_place(num_decodes, prefill_tokens_left, budget):
    _check_budget(num_decodes, budget)
    left = budget - num_decodes
    for i, n in enumerate(prefill_tokens_left):
        prefill_tokens_left[i] = min(n, left)
        left -= prefill_tokens_left[i]
    return prefill_tokens_left


# ---------------------------------------------------------------- early_step


@mutant("early_step", "a prompt that does not fit is skipped: shorter ones behind it jump the queue")
def _early_first_fit(num_decodes, waiting_prompt_lens, budget, free_seqs):
    admitted, left = [], budget
    for n in waiting_prompt_lens:
        if len(admitted) == free_seqs:
            break
        if n <= left:
            admitted.append(n)
            left -= n
    return admitted if admitted else [1] * num_decodes


@mutant("early_step", "the running decodes ride along in a prefill step (decodes plus prompts)")
def _early_mixed(num_decodes, waiting_prompt_lens, budget, free_seqs):
    admitted = ref.early_step(0, waiting_prompt_lens, budget, free_seqs)
    return [1] * num_decodes + admitted


@mutant("early_step", "the free batch slots are not counted: prompts are admitted past free_seqs")
def _early_no_slots(num_decodes, waiting_prompt_lens, budget, free_seqs):
    return ref.early_step(num_decodes, waiting_prompt_lens, budget, len(waiting_prompt_lens))


@mutant("early_step", "a prompt that fits what is left exactly waits (>= instead of >)")
def _early_exact_fit_waits(num_decodes, waiting_prompt_lens, budget, free_seqs):
    admitted, left = [], budget
    for n in waiting_prompt_lens:
        if len(admitted) == free_seqs or n >= left:
            break
        admitted.append(n)
        left -= n
    return admitted if admitted else [1] * num_decodes


@mutant("early_step", "the running decodes are charged to a prefill step's budget, though they stall")
def _early_decodes_charged(num_decodes, waiting_prompt_lens, budget, free_seqs):
    admitted, left = [], budget - num_decodes
    for n in waiting_prompt_lens:
        if len(admitted) == free_seqs or n > left:
            break
        admitted.append(n)
        left -= n
    return admitted if admitted else [1] * num_decodes


# ---------------------------------------------------------------- chunk_causal_mask


@mutant("chunk_causal_mask", "the chunk's queries are placed at positions 0 .. n-1, not after the cached tokens")
def _mask_no_offset(num_new_tokens, context_len):
    ref.chunk_causal_mask(num_new_tokens, context_len)  # the same input checks
    return torch.arange(context_len)[None, :] <= torch.arange(num_new_tokens)[:, None]


@mutant("chunk_causal_mask", "strictly before: a query does not see its own key (< instead of <=)")
def _mask_strict(num_new_tokens, context_len):
    ref.chunk_causal_mask(num_new_tokens, context_len)
    qpos = torch.arange(context_len - num_new_tokens, context_len)
    return torch.arange(context_len)[None, :] < qpos[:, None]


@mutant("chunk_causal_mask", "a 0/1 integer tensor, not a bool mask")
def _mask_int(num_new_tokens, context_len):
    return ref.chunk_causal_mask(num_new_tokens, context_len).to(torch.int64)


@mutant("chunk_causal_mask", "num_new_tokens > context_len is not rejected")
def _mask_no_upper_check(num_new_tokens, context_len):
    if num_new_tokens < 1:
        raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
    qpos = torch.arange(context_len - num_new_tokens, context_len)
    return torch.arange(context_len)[None, :] <= qpos[:, None]


@mutant("chunk_causal_mask", "off by one: each query also sees the key right after it")
def _mask_one_ahead(num_new_tokens, context_len):
    ref.chunk_causal_mask(num_new_tokens, context_len)
    qpos = torch.arange(context_len - num_new_tokens, context_len)
    return torch.arange(context_len)[None, :] <= qpos[:, None] + 1


# ---------------------------------------------------------------- chunked_prefill_latency


def _steps(prompt_len, num_decodes, budget):
    room = budget - num_decodes
    if room < 1:
        raise ValueError(f"budget {budget} leaves no room for the prompt next to {num_decodes} decodes")
    chunks, left = [], prompt_len
    while left > 0:
        chunks.append(min(left, room))
        left -= chunks[-1]
    return chunks


@mutant("chunked_prefill_latency", "the fixed overhead is paid once, not by every step")
def _latency_overhead_once(prompt_len, num_decodes, budget, overhead_s, per_token_s):
    times = [per_token_s * (num_decodes + c) for c in _steps(prompt_len, num_decodes, budget)]
    return overhead_s + sum(times), overhead_s + max(times)


@mutant("chunked_prefill_latency", "the last chunk is charged as a full one (ceil(prompt / room) full steps)")
def _latency_full_last_chunk(prompt_len, num_decodes, budget, overhead_s, per_token_s):
    steps = _steps(prompt_len, num_decodes, budget)
    t = overhead_s + per_token_s * budget
    return len(steps) * t, t


@mutant("chunked_prefill_latency", "the decodes are not charged to the budget: the prompt gets the whole budget")
def _latency_decodes_uncharged(prompt_len, num_decodes, budget, overhead_s, per_token_s):
    if budget <= num_decodes:
        raise ValueError(f"budget {budget} leaves no room for the prompt")
    times = [overhead_s + per_token_s * (num_decodes + c) for c in _steps(prompt_len, 0, budget)]
    return sum(times), max(times)


@mutant("chunked_prefill_latency", "max ITL is the mean step time, not the longest")
def _latency_mean_itl(prompt_len, num_decodes, budget, overhead_s, per_token_s):
    times = [overhead_s + per_token_s * (num_decodes + c) for c in _steps(prompt_len, num_decodes, budget)]
    return sum(times), sum(times) / len(times)


@mutant("chunked_prefill_latency", "a step's cost counts the prompt's tokens only, not the decodes'")
def _latency_decode_tokens_free(prompt_len, num_decodes, budget, overhead_s, per_token_s):
    times = [overhead_s + per_token_s * c for c in _steps(prompt_len, num_decodes, budget)]
    return sum(times), max(times)


# ---------------------------------------------------------------- decode_stall_steps


def _decoding(times, end):
    return bool(times) and times[0] < end <= times[-1]


@mutant("decode_stall_steps", "stalled (step, request) pairs are counted, not steps")
def _stalls_per_request(step_ends, token_times):
    return sum(1 for e in step_ends for t in token_times if _decoding(t, e) and e not in t)


@mutant("decode_stall_steps", "a request counts as decoding before its first token too (while it waits)")
def _stalls_before_first_token(step_ends, token_times):
    return sum(1 for e in step_ends if any(t and e <= t[-1] and e not in t for t in token_times))


@mutant("decode_stall_steps", "a request counts as decoding after its last token too (until the run ends)")
def _stalls_after_finish(step_ends, token_times):
    return sum(1 for e in step_ends if any(t and t[0] < e and e not in t for t in token_times))


@mutant("decode_stall_steps", "a step stalls only when every decoding request got no token")
def _stalls_all_not_any(step_ends, token_times):
    count = 0
    for e in step_ends:
        decoding = [t for t in token_times if _decoding(t, e)]
        if decoding and all(e not in t for t in decoding):
            count += 1
    return count
