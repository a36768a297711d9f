"""Seams: a learner's function takes the place of the engine's own, and the engine stays exact.

Fast checks on a tiny random Llama; tests/test_capstone.py runs the real model.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minillm import SamplingParams, seams
from test_spec_engine import assert_all_free, run, tiny_engine, tiny_prompts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import solutions.ch01_static_batching as s01  # noqa: E402
import solutions.ch02_continuous_batching as s02  # noqa: E402
import solutions.ch03_paged_attention as s03  # noqa: E402
import solutions.ch05_speculative_sampling as s05  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests time nothing: one thread keeps them quick on a shared machine."""


def schedule_of(engine):
    return [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in engine.step_records]


def test_plug_rejects_unknown_seams_and_non_functions():
    with pytest.raises(ValueError, match="is not a seam"):
        with seams.plug(schedule_stepp=s02.schedule_step):
            pass
    with pytest.raises(ValueError, match="needs a function"):
        with seams.plug(schedule_step=42):
            pass


def test_plug_restores_the_library_even_after_an_error():
    with pytest.raises(RuntimeError):
        with seams.plug(schedule_step=s02.schedule_step):
            assert seams.plugged("schedule_step") is not None
            raise RuntimeError("boom")
    assert seams.plugged("schedule_step") is None


def test_a_plugged_function_that_calls_the_library_gets_the_library():
    seen = []

    def mine(tokens, n, k):
        seen.append(seams.plugged("ngram_propose"))  # inside: the seam reads as unplugged
        return s05.ngram_propose(tokens, n, k)

    with seams.plug(ngram_propose=mine):
        from minillm.spec_decode.ngram import NgramProposer

        assert NgramProposer(n_max=2, n_min=1, k=2).propose([1, 2, 3, 1, 2]) == [3, 1]
    assert seen and all(s is None for s in seen)


def test_spec_seams_keep_greedy_output_and_blocks():
    prompts = tiny_prompts(4)
    spec = dict(method="ngram", num_speculative_tokens=3, adaptive=True, prompt_lookup_min=1,
                disable_by_batch_size=None)
    ref_engine = tiny_engine(spec, attention_backend="torch")
    ref = run(ref_engine, prompts, GREEDY)
    eng = tiny_engine(spec, attention_backend="torch")
    with seams.plug(rejection_sample_one=s05.rejection_sample_one, ngram_propose=s05.ngram_propose,
                    next_num_speculative_tokens=s05.next_num_speculative_tokens,
                    paged_decode_attention=s03.paged_decode_attention):
        got = run(eng, prompts, GREEDY)
    assert got == ref
    assert schedule_of(eng) == schedule_of(ref_engine)
    assert eng.speculator.stats.num_drafts > 0 and eng.speculator.stats.num_accepted > 0
    assert_all_free(eng)


def test_a_verifier_that_accepts_every_draft_changes_the_output():
    prompts = tiny_prompts(4)
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=None)
    ref = run(tiny_engine(spec), prompts, GREEDY)

    def accept_all(draft_tokens, q, p, uniforms):
        return list(draft_tokens), p[len(draft_tokens)]

    eng = tiny_engine(spec)
    with seams.plug(rejection_sample_one=accept_all):
        assert run(eng, prompts, GREEDY) != ref


@pytest.mark.parametrize("engine,seam,fn", [("continuous", "schedule_step", s02.schedule_step),
                                            ("static", "static_schedule", s01.static_schedule)])
def test_scheduling_seams_reproduce_the_library_schedule(engine, seam, fn):
    prompts = tiny_prompts(6, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12, 2, 7)]
    ref_engine = tiny_engine(engine=engine, max_num_seqs=3)
    ref = [o.token_ids for o in ref_engine.run([ref_engine.make_request(p, sp) for p, sp in zip(prompts, params)])]
    eng = tiny_engine(engine=engine, max_num_seqs=3)
    with seams.plug(**{seam: fn}):
        got = [o.token_ids for o in eng.run([eng.make_request(p, sp) for p, sp in zip(prompts, params)])]
    assert got == ref and schedule_of(eng) == schedule_of(ref_engine)
    assert_all_free(eng)


def test_a_scheduler_that_waits_for_the_batch_to_drain_changes_the_schedule():
    def drain_first(running, waiting, B, T):
        running[:] = [r for r in running if not r.is_finished]
        if running:  # wrong: nobody joins until everyone has left
            return [(r, 1) for r in running]
        return s02.schedule_step(running, waiting, B, T)

    prompts = tiny_prompts(6, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12, 2, 7)]
    ref_engine = tiny_engine(engine="continuous", max_num_seqs=3)
    ref_engine.run([ref_engine.make_request(p, sp) for p, sp in zip(prompts, params)])
    eng = tiny_engine(engine="continuous", max_num_seqs=3)
    with seams.plug(schedule_step=drain_first):
        eng.run([eng.make_request(p, sp) for p, sp in zip(prompts, params)])
    assert schedule_of(eng) != schedule_of(ref_engine)


def test_a_policy_the_engine_cannot_carry_out_is_a_clear_error():
    def overtakes(running, waiting, B, T):
        r = waiting.pop()  # the newest, not the oldest
        return [(r, r.num_tokens)]

    eng = tiny_engine(engine="continuous", max_num_seqs=3)
    for p in tiny_prompts(2):
        eng.add_request(p, GREEDY)
    with seams.plug(schedule_step=overtakes):
        with pytest.raises(seams.SeamContractError, match=r"step 1: admissions take the oldest waiting requests"):
            eng.step()
    # stopped before acting on it: nothing admitted, no block taken
    assert not eng.scheduler.running and len(eng.scheduler.waiting) == 2
    bm = eng.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_step_that_forgets_to_charge_the_decodes_stops_the_engine_at_the_step_it_overspends():
    def decodes_uncharged(running, waiting, B, T):
        running[:] = [r for r in running if not r.is_finished]
        rows, budget = [(r, 1) for r in running], T  # wrong: the decodes are not charged
        while waiting and len(running) < B and waiting[0].num_tokens <= budget:
            r = waiting.popleft()
            running.append(r)
            rows.append((r, r.num_tokens))
            budget -= r.num_tokens
        return rows

    a, b, c, d = tiny_prompts(4, seed=1)  # 8, 10, 12 and 14 tokens
    prompts = [a[:8], b[:8], (c + d)[:15]]  # step 1 feeds 8 + 8; the 15 must wait while 2 decode
    eng = tiny_engine(engine="continuous", max_num_seqs=3, max_num_batched_tokens=16)
    for p in prompts:
        eng.add_request(p, GREEDY)
    with seams.plug(schedule_step=decodes_uncharged):
        with pytest.raises(seams.SeamContractError, match=r"step 2: the rows feed at most max_num_batched_tokens=16"):
            eng.run([])


def test_block_seams_keep_the_engine_exact_under_preemption():
    prompts = tiny_prompts(6, seed=5)
    opts = dict(max_num_seqs=4, num_blocks=12, block_size=4, max_model_len=48)
    ref_engine = tiny_engine(**opts)
    ref_reqs = [ref_engine.make_request(p, GREEDY) for p in prompts]
    ref = [o.token_ids for o in ref_engine.run(ref_reqs)]
    assert any(r.metrics.num_preemptions for r in ref_reqs), "the pool must be small enough to preempt"
    eng = tiny_engine(**opts)
    with seams.plug(blocks_needed=s03.blocks_needed, slot_mapping=s03.slot_mapping,
                    allocate_blocks=s03.allocate_blocks, free_blocks=s03.free_blocks,
                    choose_victim=s03.choose_victim):
        got = run(eng, prompts, GREEDY)
    assert got == ref and schedule_of(eng) == schedule_of(ref_engine)
    assert_all_free(eng)


def test_an_allocator_that_leaks_on_free_is_caught():
    def leaky_free(free_list, ref_counts, block_ids):
        s03.free_blocks(free_list, ref_counts, list(block_ids)[:-1])  # forgets the last block

    eng = tiny_engine(max_num_seqs=4, num_blocks=40, block_size=4, max_model_len=48)
    for p in tiny_prompts(3):
        eng.add_request(p, GREEDY)
    allocator = eng.scheduler.block_manager.allocator
    with seams.plug(free_blocks=leaky_free):
        with pytest.raises(seams.SeamContractError, match="free_blocks.*freeing drops one reference"):
            while eng.has_unfinished():  # up to the first free: the call that would leak
                eng.step()
    # stopped before acting on the answer: the allocator's free list and counts still agree
    allocator.check_invariants()


def test_a_leak_that_starves_the_engine_raises_instead_of_spinning():
    # Blocks that no block table holds (a plugged free_blocks can no longer leak: it is checked
    # at the call): the pool stays dry and no request can ever start.
    eng = tiny_engine(max_num_seqs=2, num_blocks=12, block_size=4, max_model_len=48)
    eng.scheduler.block_manager.allocator.allocate(10)
    with pytest.raises(RuntimeError, match="no progress"):
        run(eng, tiny_prompts(6), GREEDY)
