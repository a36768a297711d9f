"""A tight KV cache degrades gracefully: preemption does not thrash.

Four requests that each grow to 3 blocks share a cache of 4 blocks. Admitting whomever
fits the blocks free *now* made them preempt each other round after round (the same
prefills recomputed again and again: 3.7x the useful tokens fed). After a preemption the
scheduler admits nobody until a running request finishes.
"""
import pytest

from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.scheduler import PagedScheduler
from tests.test_block_manager import EOS, FakeEngine


def tight_run(chunked: bool, prompt_len: int):
    sched = PagedScheduler(4, 16, 64, EOS, num_blocks=4, block_size=16, enable_chunked_prefill=chunked)
    engine = FakeEngine(sched)  # checks every K/V read back is the request's own
    reqs = [Request(str(i), [10 + i] * prompt_len, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                    arrival_time=0.0) for i in range(4)]
    for r in reqs:
        sched.add(r)
    fed = 0
    while sched.has_unfinished():
        fed += engine.step().num_tokens
    useful = sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in reqs)
    return sched, reqs, fed, useful


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prompt_len", [8, 16])
def test_tight_cache_feeds_at_most_3x_the_useful_tokens(chunked, prompt_len):
    sched, reqs, fed, useful = tight_run(chunked, prompt_len)
    assert all(r.num_output_tokens == 32 for r in reqs)
    assert sched.num_preemptions > 0, "the cache is sized to need preemption"
    assert fed <= 3 * useful, f"{fed} tokens fed for {useful} useful ({sched.num_preemptions} preemptions)"
    assert sched.block_manager.num_free_blocks == 4


@pytest.mark.slow
def test_tight_cache_real_model_exact_and_no_thrash():
    from minillm import LLM

    prompts = ["The capital of France is", "Water boils at", "The first planet is", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(engine="paged", device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4, num_blocks=4,
              max_num_batched_tokens=16)
    solo = [llm.generate(p, params)[0].token_ids for p in prompts]
    llm.engine.step_records.clear()
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == solo
    fed = sum(s.num_tokens for s in llm.engine.step_records)
    useful = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert fed <= 3 * useful, f"{fed} tokens fed for {useful} useful"
