"""The same workload through transformers, as baselines for minillm's engines.

* ``hf-generate``: ``model.generate`` on padded groups of B requests in arrival order
  (static batching as most people first meet it). Left padding to the group's longest
  prompt; the group generates as many tokens as its longest request; each request keeps
  only its own ``max_tokens``.
* ``hf-continuous``: transformers' own continuous batching (``init_continuous_batching``,
  the engine behind ``generate_batch``) with its paged KV cache, at most B requests per
  batch and the same token budget.

Both get the same prompts as token ids, greedy decoding, and EOS disabled, so every
request produces exactly its ``max_tokens`` tokens, as in minillm (``ignore_eos``).
Per-step and per-request timings are recorded from inside the run (a logits processor
for ``generate``, forward hooks for continuous batching) into the same ``StepRecord``
/ ``RequestMetrics`` shapes, so one summary function serves every engine. Slot
utilization follows the definition in summary.py, from the schedule each one runs.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from minillm.metrics import StepRecord, slot_accounting
from minillm.bench.summary import RunResult
from minillm.request import RequestMetrics
from minillm.bench.workload import Workload


def _kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize


def left_pad(prompts: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one [B, W] batch, padded on the LEFT.

    Returns (input_ids [B, W], attention_mask [B, W] with 1 on real tokens). Left, so
    that every row's last real token sits in the last column: the next token of every
    row is sampled from the same position, and generated tokens line up.
    """
    W = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (W - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    return ids, mask


def synced_now(device: torch.device | str | None = None) -> float:
    """The clock, read after the device has finished the work queued so far.

    On CUDA a launch returns before its kernels run: reading the clock without a
    synchronize would time the launches, not the work, and make a baseline look faster
    (or a later step slower) than it is. A no-op wait elsewhere.
    """
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# -- transformers generate on padded groups ---------------------------------------------

class _StepClock:
    """A logits processor that only notes when each generation step's logits are ready."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(synced_now(scores.device))
        return scores


def run_hf_generate(model, workload: Workload, max_num_seqs: int, pad_token_id: int,
                    progress: bool = False) -> RunResult:
    from transformers import LogitsProcessorList

    B = max_num_seqs
    per_token = _kv_bytes_per_token(model)
    dev = model.device
    reqs = list(workload)
    metrics = [RequestMetrics(arrival_time=0.0) for _ in reqs]
    outputs: list[list[int]] = [[] for _ in reqs]
    steps: list[StepRecord] = []
    eos_mode = "eos_token_id=None"
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=workload.output_tokens, unit="tok", desc="hf-generate")
    start = synced_now(dev)
    for i, r in enumerate(reqs):
        metrics[i].arrival_time = start + r.arrival_time
    nxt = 0
    while nxt < len(reqs):
        # A group: up to B requests that have arrived, in arrival order (wait for the first).
        _wait_until(metrics[nxt].arrival_time)
        now = time.perf_counter()
        group = [nxt]
        while len(group) < B and nxt + len(group) < len(reqs) and metrics[nxt + len(group)].arrival_time <= now:
            group.append(nxt + len(group))
        nxt += len(group)
        prompts = [reqs[i].prompt_token_ids for i in group]
        want = [reqs[i].max_tokens for i in group]
        W, M = max(map(len, prompts)), max(want)
        ids, mask = left_pad(prompts, pad_token_id, dev)  # [G, W] each
        clock = _StepClock()
        g_start = synced_now(dev)
        for i in group:
            metrics[i].first_scheduled_time = g_start
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=M, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad_token_id,
                                 logits_processor=LogitsProcessorList([clock]))
        if gen.shape[1] - W < M:  # this transformers stopped at EOS anyway: force the length
            eos_mode = "min_new_tokens"
            clock = _StepClock()
            with torch.inference_mode():
                gen = model.generate(ids, attention_mask=mask, max_new_tokens=M, min_new_tokens=M, do_sample=False,
                                     pad_token_id=pad_token_id, logits_processor=LogitsProcessorList([clock]))
        new = gen[:, W:].tolist()
        t = clock.times  # t[k]: logits of token k+1 of every row are ready
        for row, i in enumerate(group):
            m = metrics[i]
            outputs[i] = new[row][:want[row]]
            m.token_times = t[:want[row]]
            m.first_token_time = t[0]
            m.finish_time = t[want[row] - 1]
        # The schedule generate ran: one padded prefill, then M-1 decode steps over the
        # whole group; a row is useful while its request still needs tokens.
        for k in range(M):
            if k == 0:
                live = list(range(len(group)))
                new_tokens, width = [len(p) for p in prompts], W
            else:
                live = [row for row in range(len(group)) if want[row] > k]
                new_tokens, width = [1] * len(live), 1
            slots, padded, idle = slot_accounting(new_tokens, B, width)
            fed = [len(p) + min(k, w - 1) for p, w in zip(prompts, want)]  # real tokens in each row's cache
            steps.append(StepRecord(
                len(steps), t[k - 1] if k else g_start, t[k], [reqs[group[r]].request_id for r in live], new_tokens,
                len(live), len(live), len(reqs) - nxt, num_slots=B, token_slots=slots, padded_tokens=padded,
                idle_slots=idle, context_tokens=sum(fed[r] for r in live), max_context=W + k,
                kv_reserved_bytes=len(group) * (W + k) * per_token, kv_used_bytes=sum(fed) * per_token,
                held_ids=[reqs[group[r]].request_id for r in range(len(group)) if r not in live]))
        if bar:
            bar.update(sum(want))
    if bar:
        bar.close()
    peak = max(s.kv_reserved_bytes for s in steps)
    return RunResult("hf-generate", metrics, outputs, steps, start, max(m.finish_time for m in metrics), B,
                     kv_cache_bytes=peak, num_prompt_tokens=[len(r.prompt_token_ids) for r in reqs],
                     extra={"eos_handling": eos_mode})


# -- transformers continuous batching ----------------------------------------------------

def _cb_configs(max_num_seqs: int, budget: int, num_blocks: int, page_size: int, max_new_tokens: int, pad: int):
    """(GenerationConfig, ContinuousBatchingConfig or None) for this transformers version."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad)
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:  # older releases read these from the GenerationConfig
        for k, v in dict(num_blocks=num_blocks, block_size=page_size, max_batch_tokens=budget,
                         max_requests_per_batch=max_num_seqs, scheduler="fifo").items():
            setattr(gen, k, v)
        return gen, None
    import inspect

    fields = inspect.signature(ContinuousBatchingConfig).parameters
    kw: dict[str, Any] = dict(num_blocks=num_blocks, max_batch_tokens=budget, max_requests_per_batch=max_num_seqs,
                              allow_block_sharing=False, scheduler_type="fifo")
    kw["page_size" if "page_size" in fields else "block_size"] = page_size
    return gen, ContinuousBatchingConfig(**{k: v for k, v in kw.items() if k in fields})


def run_hf_continuous(model, workload: Workload, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int, pad_token_id: int, progress: bool = False,
                      page_size: int = 256) -> RunResult:
    B = max_num_seqs
    per_token = _kv_bytes_per_token(model)
    reqs = list(workload)
    # The same KV memory as minillm's contiguous engines: B regions of max_model_len.
    num_blocks = max(1, math.ceil(B * max_model_len / page_size))
    gen_cfg, cb_cfg = _cb_configs(B, max_num_batched_tokens, num_blocks, page_size,
                                  max(r.max_tokens for r in reqs), pad_token_id)

    # Observe every forward: its flat batch says how many rows and tokens it ran.
    fwd: list[dict[str, Any]] = []

    def before(module, args, kwargs):
        cu_q = kwargs.get("cu_seq_lens_q")
        cu_k = kwargs.get("cu_seq_lens_k")
        if isinstance(cu_k, dict):
            cu_k = next(iter(cu_k.values()), None)
        rec: dict[str, Any] = {"start": synced_now(model.device), "q": None, "k": None}
        if torch.is_tensor(cu_q):
            q = cu_q.tolist()
            rec["q"] = [b - a for a, b in zip(q, q[1:]) if b > a]
        if torch.is_tensor(cu_k):
            k = cu_k.tolist()
            rec["k"] = [b - a for a, b in zip(k, k[1:]) if b > a]
        fwd.append(rec)

    def after(module, args, output):
        if fwd:
            fwd[-1]["end"] = synced_now(model.device)

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True), model.register_forward_hook(after)]
    kwargs = {"generation_config": gen_cfg}
    if cb_cfg is not None:
        kwargs["continuous_batching_config"] = cb_cfg
    results: dict[str, Any] = {}
    bar = None
    try:
        manager = model.init_continuous_batching(**kwargs)
        manager.start()
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), unit="req", desc="hf-continuous")
        start = synced_now(model.device)
        arrivals = {r.request_id: start + r.arrival_time for r in reqs}
        pending = list(reqs)
        while len(results) < len(reqs):
            now = time.perf_counter()
            while pending and arrivals[pending[0].request_id] <= now:
                r = pending.pop(0)
                manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.max_tokens,
                                    record_timestamps=True)
            out = manager.get_result(timeout=0.05)
            if out is not None and out.is_finished():
                if getattr(out, "error", None):
                    raise RuntimeError(f"transformers continuous batching failed request {out.request_id}: {out.error}")
                results[out.request_id] = out
                if bar:
                    bar.update(1)
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped before finishing the requests")
        manager.stop(block=True)
    finally:
        for h in hooks:
            h.remove()
        if bar:
            bar.close()
        try:
            model.destroy_cached_continuous_batching_manager()
        except Exception:
            pass
    metrics, outputs = [], []
    for r in reqs:
        o = results[r.request_id]
        ts = list(o.timestamps or [])
        m = RequestMetrics(arrival_time=arrivals[r.request_id], first_token_time=ts[0] if ts else None,
                           token_times=ts, finish_time=ts[-1] if ts else time.perf_counter())
        metrics.append(m)
        outputs.append(list(o.generated_tokens)[:r.max_tokens])
    steps = []
    for i, f in enumerate(x for x in fwd if x["q"] is not None):
        q = f["q"]
        ctx = f["k"] if f["k"] is not None and len(f["k"]) == len(q) else q
        slots, padded, idle = slot_accounting(q, B)
        steps.append(StepRecord(i, f["start"], f.get("end", f["start"]), [], q, len(q), len(q), 0, num_slots=B,
                                token_slots=slots, padded_tokens=padded, idle_slots=idle,
                                context_tokens=sum(ctx), max_context=max(ctx, default=0),
                                kv_used_bytes=sum(ctx) * per_token))
    return RunResult("hf-continuous", metrics, outputs, steps, start, max(m.finish_time for m in metrics), B,
                     kv_cache_bytes=num_blocks * page_size * per_token,
                     num_prompt_tokens=[len(r.prompt_token_ids) for r in reqs],
                     extra={"hf_page_size": page_size, "hf_num_blocks": num_blocks})


__all__ = ["run_hf_generate", "run_hf_continuous", "left_pad"]
