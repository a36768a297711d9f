"""Wrong answers to exercises/ch02_continuous_batching.py, each a mistake the contract rules out."""
from __future__ import annotations

from collections import deque

from minillm.request import RequestStatus
from mutants import mutant
from solutions import ch02_continuous_batching as ref


@mutant("schedule_step", "the running requests' decode tokens are not charged to the token budget")
def _decodes_uncharged(running, waiting, max_num_seqs, max_num_batched_tokens):
    running[:] = [r for r in running if not r.is_finished]
    rows = [(r, 1) for r in running]
    budget = max_num_batched_tokens  # forgot: - len(rows)
    while waiting and len(running) < max_num_seqs:
        r = waiting[0]
        n = r.num_tokens - r.num_computed_tokens
        if n > budget:
            break
        waiting.popleft()
        r.status = RequestStatus.RUNNING
        running.append(r)
        rows.append((r, n))
        budget -= n
    return rows


@mutant("schedule_step", "a shorter request behind a head that does not fit is admitted (the queue is overtaken)")
def _overtakes(running, waiting, max_num_seqs, max_num_batched_tokens):
    running[:] = [r for r in running if not r.is_finished]
    rows = [(r, 1) for r in running]
    budget = max_num_batched_tokens - len(rows)
    kept = deque()
    while waiting and len(running) < max_num_seqs:
        r = waiting.popleft()
        n = r.num_tokens - r.num_computed_tokens
        if n > budget:
            kept.append(r)  # skip it, try the next one
            continue
        r.status = RequestStatus.RUNNING
        running.append(r)
        rows.append((r, n))
        budget -= n
    waiting.extendleft(reversed(kept))
    return rows


@mutant("schedule_step", "finished requests keep their slot until the next step",
        same_in_engine="the engine's update removes finished requests before the next step is scheduled")
def _finished_keep_slot(running, waiting, max_num_seqs, max_num_batched_tokens):
    rows = [(r, 1) for r in running if not r.is_finished]
    budget = max_num_batched_tokens - len(rows)
    while waiting and len(running) < max_num_seqs:  # counts the finished ones as running
        r = waiting[0]
        n = r.num_tokens - r.num_computed_tokens
        if n > budget:
            break
        waiting.popleft()
        r.status = RequestStatus.RUNNING
        running.append(r)
        rows.append((r, n))
        budget -= n
    running[:] = [r for r in running if not r.is_finished]
    return rows


@mutant("schedule_step", "a prompt that fits the budget exactly waits (> instead of >=)")
def _exact_fit_waits(running, waiting, max_num_seqs, max_num_batched_tokens):
    running[:] = [r for r in running if not r.is_finished]
    rows = [(r, 1) for r in running]
    budget = max_num_batched_tokens - len(rows)
    while waiting and len(running) < max_num_seqs:
        r = waiting[0]
        n = r.num_tokens - r.num_computed_tokens
        if n >= budget:
            break
        waiting.popleft()
        r.status = RequestStatus.RUNNING
        running.append(r)
        rows.append((r, n))
        budget -= n
    return rows


@mutant("continuous_num_steps", "a finished request's slot is freed one step late")
def _steps_free_late(prompt_lens, output_lens, max_num_seqs, max_num_batched_tokens):
    waiting = list(range(len(prompt_lens)))
    running, generated, steps = [], [0] * len(prompt_lens), 0
    while waiting or running:
        done = [i for i in running if generated[i] >= output_lens[i]]
        budget = max_num_batched_tokens - (len(running) - len(done))
        for i in running:
            generated[i] += 1
        while waiting and len(running) < max_num_seqs and prompt_lens[waiting[0]] <= budget:
            i = waiting.pop(0)
            budget -= prompt_lens[i]
            generated[i] += 1
            running.append(i)
        running = [i for i in running if i not in done]
        steps += 1
    return steps


@mutant("continuous_num_steps", "the prefill step does not produce the first token (one step more per request)")
def _steps_prefill_no_token(prompt_lens, output_lens, max_num_seqs, max_num_batched_tokens):
    return ref.continuous_num_steps(prompt_lens, [o + 1 for o in output_lens], max_num_seqs, max_num_batched_tokens)


@mutant("continuous_num_steps", "the token budget is ignored: every head is admitted while a slot is free")
def _steps_no_budget(prompt_lens, output_lens, max_num_seqs, max_num_batched_tokens):
    return ref.continuous_num_steps(prompt_lens, output_lens, max_num_seqs, 10 ** 9)


@mutant("predict_makespan", "a decode row's context leaves out the token fed this step")
def _makespan_context_short(prompt_lens, output_lens, max_num_seqs, engine, step_time):
    return ref.predict_makespan(prompt_lens, output_lens, max_num_seqs, engine,
                                lambda new, ctx, ns: step_time(new, [c - 1 if n == 1 else c for n, c in zip(new, ctx)], ns))


@mutant("predict_makespan", "static batching refills a finished member's slot (it behaves like continuous)")
def _makespan_static_refills(prompt_lens, output_lens, max_num_seqs, engine, step_time):
    return ref.predict_makespan(prompt_lens, output_lens, max_num_seqs, "continuous", step_time)


@mutant("predict_makespan", "finished static members keep a row until their group is done")
def _makespan_static_padded(prompt_lens, output_lens, max_num_seqs, engine, step_time):
    if engine != "static":
        return ref.predict_makespan(prompt_lens, output_lens, max_num_seqs, engine, step_time)
    total, i = 0.0, 0
    while i < len(prompt_lens):
        group = list(range(i, min(i + max_num_seqs, len(prompt_lens))))
        total += step_time([prompt_lens[j] for j in group], [prompt_lens[j] for j in group], len(group))
        for k in range(1, max(output_lens[j] for j in group)):
            total += step_time([1] * len(group), [prompt_lens[j] + k for j in group], len(group))
        i += max_num_seqs
    return total


@mutant("pick_engine", "ties are not given to static: the smaller makespan wins outright")
def _pick_no_tie_rule(prompt_lens, output_lens, max_num_seqs, step_time):
    s = ref.predict_makespan(prompt_lens, output_lens, max_num_seqs, "static", step_time)
    c = ref.predict_makespan(prompt_lens, output_lens, max_num_seqs, "continuous", step_time)
    return "continuous" if c <= s else "static"


@mutant("pick_engine", "the engines are swapped: the larger makespan is picked")
def _pick_swapped(prompt_lens, output_lens, max_num_seqs, step_time):
    s = ref.predict_makespan(prompt_lens, output_lens, max_num_seqs, "static", step_time)
    c = ref.predict_makespan(prompt_lens, output_lens, max_num_seqs, "continuous", step_time)
    return "static" if c < s * 0.999 else "continuous"


@mutant("pick_engine", "continuous batching is always picked")
def _pick_always_continuous(prompt_lens, output_lens, max_num_seqs, step_time):
    return "continuous"
