"""Wrong answers to exercises/ch01_static_batching.py, each a mistake the contract rules out."""
from __future__ import annotations

import torch

from minillm.request import RequestStatus
from mutants import mutant


def _groups(xs, B):
    return [xs[i:i + B] for i in range(0, len(xs), B)]


# ---------------------------------------------------------------- left_pad


@mutant("left_pad", "pads on the right: the last column holds pad tokens for every shorter row")
def _pad_right(prompts, pad_id):
    W = max(len(p) for p in prompts)
    ids = [p + [pad_id] * (W - len(p)) for p in prompts]
    mask = [[1] * len(p) + [0] * (W - len(p)) for p in prompts]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


@mutant("left_pad", "the mask is read off the ids (ids != pad_id): a real token equal to pad_id is masked out")
def _mask_from_ids(prompts, pad_id):
    W = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (W - len(p)) + p for p in prompts], dtype=torch.long)
    return ids, (ids != pad_id).long()


@mutant("left_pad", "the mask is inverted: 1 on padding, 0 on real tokens")
def _mask_inverted(prompts, pad_id):
    W = max(len(p) for p in prompts)
    ids = [[pad_id] * (W - len(p)) + p for p in prompts]
    mask = [[1] * (W - len(p)) + [0] * len(p) for p in prompts]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


@mutant("left_pad", "the prompts are padded in place: the caller's lists come back longer")
def _pads_in_place(prompts, pad_id):
    W = max(len(p) for p in prompts)
    mask = [[0] * (W - len(p)) + [1] * len(p) for p in prompts]
    for p in prompts:
        p[:0] = [pad_id] * (W - len(p))
    return torch.tensor(prompts, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


# ---------------------------------------------------------------- static_num_steps


@mutant("static_num_steps", "every group lasts as long as the longest request of the whole run")
def _steps_global_max(output_lens, max_num_seqs):
    return len(_groups(output_lens, max_num_seqs)) * max(output_lens)


@mutant("static_num_steps", "the prefill is counted as a step of its own (n + 1 steps for n tokens)")
def _steps_prefill_extra(output_lens, max_num_seqs):
    return sum(max(g) + 1 for g in _groups(output_lens, max_num_seqs))


@mutant("static_num_steps", "a last group smaller than B is dropped (len // B groups)")
def _steps_drop_last_group(output_lens, max_num_seqs):
    full = len(output_lens) // max_num_seqs * max_num_seqs
    return sum(max(g) for g in _groups(output_lens[:full], max_num_seqs))


@mutant("static_num_steps", "requests are sorted by length before grouping (not in arrival order)")
def _steps_sorted(output_lens, max_num_seqs):
    return sum(max(g) for g in _groups(sorted(output_lens), max_num_seqs))


# ---------------------------------------------------------------- static_token_slots


def _slots(prompt_lens, output_lens, B, rows_of, useful_while, decode_steps_of, prefill_slots_of):
    useful = total = 0
    for ps, os in zip(_groups(prompt_lens, B), _groups(output_lens, B)):
        rows = rows_of(ps, B)
        useful += sum(ps)
        total += prefill_slots_of(ps, rows)
        for k in range(1, decode_steps_of(os) + 1):
            total += rows
            useful += sum(1 for o in os if useful_while(k, o))
    return useful, total


def _full(ps, B):
    return B


def _padded(ps, rows):
    return rows * max(ps)


def _still_needs(k, o):
    return k < o


def _m_minus_1(os):
    return max(os) - 1


@mutant("static_token_slots", "a last group smaller than B counts only its own rows, not B")
def _slots_small_group_own_rows(prompt_lens, output_lens, max_num_seqs):
    return _slots(prompt_lens, output_lens, max_num_seqs, lambda ps, B: len(ps), _still_needs, _m_minus_1, _padded)


@mutant("static_token_slots", "a member is useful in decode step k while k <= its output length (one step too many)")
def _slots_useful_inclusive(prompt_lens, output_lens, max_num_seqs):
    return _slots(prompt_lens, output_lens, max_num_seqs, _full, lambda k, o: k <= o, _m_minus_1, _padded)


@mutant("static_token_slots", "a group runs M decode steps after its prefill (the prefill's token forgotten)")
def _slots_m_decodes(prompt_lens, output_lens, max_num_seqs):
    return _slots(prompt_lens, output_lens, max_num_seqs, _full, _still_needs, max, _padded)


@mutant("static_token_slots", "the prefill step counts only the real prompt tokens: padding costs nothing")
def _slots_prefill_unpadded(prompt_lens, output_lens, max_num_seqs):
    return _slots(prompt_lens, output_lens, max_num_seqs, _full, _still_needs, _m_minus_1,
                  lambda ps, rows: sum(ps))


# ---------------------------------------------------------------- static_schedule


def _form_group(group, waiting, max_num_seqs, budget, fits=lambda n, left: n <= left):
    rows = []
    while waiting and len(group) < max_num_seqs:
        r = waiting[0]
        n = r.num_tokens - r.num_computed_tokens
        if not fits(n, budget):
            break
        waiting.popleft()
        r.status = RequestStatus.RUNNING
        group.append(r)
        rows.append((r, n))
        budget -= n
    return rows


@mutant("static_schedule", "a finished member's slot is refilled from `waiting` while the group still runs")
def _refills_finished_slots(group, waiting, max_num_seqs, max_num_batched_tokens):
    live = [r for r in group if not r.is_finished]
    rows = [(r, 1) for r in live]
    group[:] = live
    budget = max_num_batched_tokens - len(rows)
    return rows + _form_group(group, waiting, max_num_seqs, budget)


@mutant("static_schedule", "finished members keep getting a decode row until the group is done")
def _decodes_finished_members(group, waiting, max_num_seqs, max_num_batched_tokens):
    if any(not r.is_finished for r in group):
        return [(r, 1) for r in group]
    group.clear()
    return _form_group(group, waiting, max_num_seqs, max_num_batched_tokens)


@mutant("static_schedule", "the token budget is not checked: B requests join whatever their prompts")
def _ignores_budget(group, waiting, max_num_seqs, max_num_batched_tokens):
    live = [r for r in group if not r.is_finished]
    if live:
        return [(r, 1) for r in live]
    group.clear()
    return _form_group(group, waiting, max_num_seqs, max_num_batched_tokens, fits=lambda n, left: True)


@mutant("static_schedule", "a shorter request behind a head that does not fit joins the group (the queue is overtaken)")
def _overtakes(group, waiting, max_num_seqs, max_num_batched_tokens):
    live = [r for r in group if not r.is_finished]
    if live:
        return [(r, 1) for r in live]
    group.clear()
    rows, budget, kept = [], max_num_batched_tokens, []
    while waiting and len(group) < max_num_seqs:
        r = waiting.popleft()
        n = r.num_tokens - r.num_computed_tokens
        if n > budget:
            kept.append(r)  # skip it, try the next one
            continue
        r.status = RequestStatus.RUNNING
        group.append(r)
        rows.append((r, n))
        budget -= n
    waiting.extendleft(reversed(kept))
    return rows


@mutant("static_schedule", "a prompt that fits what is left of the budget exactly waits (>= instead of >)")
def _exact_fit_waits(group, waiting, max_num_seqs, max_num_batched_tokens):
    live = [r for r in group if not r.is_finished]
    if live:
        return [(r, 1) for r in live]
    group.clear()
    return _form_group(group, waiting, max_num_seqs, max_num_batched_tokens, fits=lambda n, left: n < left)


@mutant("static_schedule", "a done group is not emptied: its finished members still fill the slots of the next one",
        same_in_engine="the engine releases a group the moment its last member finishes (StaticScheduler.update, "
                       "and schedule after an abort), so it never hands the step a group whose members all finished")
def _done_group_kept(group, waiting, max_num_seqs, max_num_batched_tokens):
    live = [r for r in group if not r.is_finished]
    if live:
        return [(r, 1) for r in live]
    return _form_group(group, waiting, max_num_seqs, max_num_batched_tokens)
