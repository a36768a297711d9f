"""``python -m minillm bench``: one workload through several engines, side by side.

    python -m minillm bench --engine continuous,static --workload skewed --num-requests 32 --seed 0 \\
        --max-num-seqs 8 --json /tmp/bench.json

Every engine runs in this one process, on the same requests (the same prompt token
ids, the same ``max_tokens`` with EOS ignored, greedy), so they do identical work; the
weights are loaded once. Engines:

    static         minillm, request-level batching (groups of B, padded, barrel effect)
    continuous     minillm, iteration-level scheduling, contiguous KV region per slot
    paged          minillm, continuous batching over a paged KV cache (blocks of
                   ``--block-size`` tokens, preemption by recompute when they run out)
    hf-generate    transformers ``generate`` on left-padded groups of B
    hf-continuous  transformers' continuous batching (``generate_batch``'s engine)
    vllm           vLLM (optional, its own virtualenv: ``make peer-vllm``), in a subprocess
    llamacpp       llama.cpp on the model's own GGUF, batch 1 or ``--llamacpp-parallel`` P slots
                   (optional, its own virtualenv: ``make peer-llamacpp``), in a subprocess

``--engine all`` runs all of them but the peers (vllm, llamacpp); a comma list runs those, in that order.

``--dtype`` (float32, bfloat16, float16; default: the device's, float32 on the CPU) is
the dtype of every engine: minillm's, the transformers baselines' and vLLM's. Each result
records it as ``dtype``.

vLLM side by side (``--engine continuous,vllm``): vLLM pins its own torch and
transformers, so it runs in another Python, found in this order: $MINILLM_VLLM_PYTHON,
``.venv-vllm/bin/python`` at the repository root (what ``make peer-vllm`` builds), this
Python if it can import vllm. ``minillm/bench/vllm_peer.py`` runs there on the same prompt
token ids and sampling settings (greedy, ``max_tokens``, EOS ignored), with
``max_num_seqs``, ``max_model_len``, the token budget and the dtype; it reads a
Hugging Face model folder that bench writes once from the GGUF into $MINILLM_CACHE
(default ~/.cache/minillm). Its per-token times are taken as each engine step returns,
so TTFT / TPOT / ITL / E2E are measured as for the other engines; what vLLM does not
expose here (per-step batches: forward passes, slot utilization, KV use per step) is
null in the JSON and ``-`` in the table. vLLM's CPU threads and KV space are set through
its environment (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``), see
``vllm_runner.vllm_env``; the result records both.

llama.cpp side by side (``--engine continuous,llamacpp``): ``minillm/bench/llamacpp_peer.py``
runs in the Python found in this order: $MINILLM_LLAMACPP_PYTHON, ``.venv-llamacpp/bin/python``
(what ``make peer-llamacpp`` builds), this Python if it can import llama_cpp. It loads the
GGUF minillm loads (its quantized weights as they are: the result's dtype is the GGUF's
types, e.g. ``Q4_1/Q8_0 (gguf)``; ``--dtype`` and ``--dummy-weights`` do not apply), with
``--threads`` threads and a context of ``max_model_len`` tokens, and serves the requests at
batch 1, one after the other in order of arrival: the same prompt token ids, greedy,
``max_tokens`` with EOS ignored. A request that waits for the one before it counts that
wait in its TTFT. Compare it with ``--max-num-seqs 1`` for the same batch size.

``--json PATH`` writes, for ONE engine, that engine's result object; for SEVERAL, an
object keyed by engine name whose values are those result objects. Each result object
has at least: engine, workload, num_requests, output_tokens, wall_s,
output_tokens_per_s, forward_passes, slot_utilization, ttft_s / tpot_s / itl_s / e2e_s
({p50, p95, p99}), kv_reserved_bytes (KV memory the engine allocated),
kv_used_bytes_peak; plus the settings it ran with and ``same_tokens_as``, the fraction
of requests whose tokens equal those of the first engine listed (below 1, with
``first_difference``: per request, the index of the first token that differs, or null).

KV memory (definitions in summary.py), in every minillm result: kv_waste_fraction
(reserved-but-unused share of the KV the running requests hold, time-averaged),
max_concurrency (the most requests running at once), preemptions, attention_backend.
The paged engine's KV cache is ``--num-blocks`` blocks of ``--block-size`` tokens; by
default the bytes the contiguous engine reserves, ``max_num_seqs x max_model_len``
tokens, so the engines compare at equal memory; its result adds block_size, num_blocks.
For more requests in the same bytes, give the paged engine more slots and the block
count of the contiguous engine's bytes: for 32 chat requests (max_model_len 768) at
``--max-num-seqs 8``, 8 x 768 / 16 = 384 blocks:

    python -m minillm bench --engine paged --workload chat --max-num-seqs 32 --num-blocks 384

Chunked prefill (paged engine only): ``--enable-chunked-prefill`` gives every running
decode its token first, then fills what is left of ``--max-num-batched-tokens`` with
prompt chunks; without it a step is all-prefill or all-decode. vLLM's scheduler always
works this way, so ``--engine paged,vllm --enable-chunked-prefill`` compares one policy. Every result reports
itl_s.max, max_step_tokens and decode_stall_steps (steps in which a running, decoding
request produced no token). On ``long-prompt-arrival`` (requests decoding when long
prompts arrive), compare

    python -m minillm bench --engine paged --workload long-prompt-arrival --num-requests 8
    python -m minillm bench --engine paged --workload long-prompt-arrival --num-requests 8 \\
        --enable-chunked-prefill --max-num-batched-tokens 256

Speculative decoding (paged engine only, chapter 5): ``--speculative ngram`` (prompt
lookup), ``--speculative model`` (a self-draft of ``--draft-layers``) or ``--speculative
medusa`` (Medusa heads, a chain or with ``--medusa-tree`` a candidate tree), k =
``--num-speculative-tokens``; the result adds acceptance_rate, mean_accepted_tokens,
tokens_per_target_forward, target_forwards, draft_forwards. Run the same command without
``--speculative`` for the baseline, on ``grounded`` (answers that copy the prompt) or ``open``:

    python -m minillm bench --engine paged --workload grounded --num-requests 9 --max-num-seqs 1 \\
        --speculative ngram --num-speculative-tokens 4

Many users (paged engine only, chapter 6): ``--enable-prefix-caching`` shares the KV
blocks of equal prompt prefixes; every result reports prefill_tokens_requested,
prefix_hit_tokens, prefill_tokens_computed, prefix_hit_rate and cached_blocks_peak.
``--scheduling-policy priority`` admits by class (interactive > standard > batch) with
per-class queue timeouts (``--queue-timeout interactive=0.05``, repeatable); every
result has ``per_class``: TTFT and queue-wait percentiles, timeouts_hit and
slo_attainment per class (a table is printed when the workload has several classes).
Both targets of the chapter, side by side in one command:

    python -m minillm.bench.many_users
    python -m minillm bench --engine paged --workload shared-prefix --num-requests 32 --enable-prefix-caching
    python -m minillm bench --engine paged --workload mixed-priority --num-requests 24 --scheduling-policy priority
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Callable, Sequence

from minillm.config import ATTENTION_BACKENDS, ENGINES, EngineConfig
from minillm.bench.summary import RunResult, format_class_table, format_table, summarize
from minillm.bench.workload import WORKLOADS, Workload, make_workload
from minillm.bench.vllm_runner import VllmFailed, VllmNotFound, find_vllm_python, run_vllm, vllm_model_dir
from minillm.bench.llamacpp_runner import (LlamaCppFailed, LlamaCppNotFound, check_context, find_llamacpp_python,
                                           gguf_weight_types, run_llamacpp)
from minillm.bench import llamacpp_runner
from minillm.threads import keeps_torch_threads


MINILLM_ENGINES = tuple(e for e in ENGINES if e != "simple")  # "simple" is continuous with one slot
HF_ENGINES = ("hf-generate", "hf-continuous")
PEER_ENGINES = ("vllm", "llamacpp")  # other projects, in another Python: not part of 'all'
BENCH_ENGINES = MINILLM_ENGINES + HF_ENGINES + PEER_ENGINES
DTYPES = ("float32", "bfloat16", "float16")


def parse_engines(spec: str) -> list[str]:
    """``'all'`` (every engine but the peers, vllm and llamacpp) or a comma list -> engine names, validated."""
    names = ([e for e in BENCH_ENGINES if e not in PEER_ENGINES] if spec.strip() == "all"
             else [s.strip() for s in spec.split(",") if s.strip()])
    bad = [n for n in names if n not in BENCH_ENGINES]
    if bad or not names:
        raise ValueError(f"unknown engine {', '.join(bad) or repr(spec)}; valid engines: "
                         f"{', '.join(BENCH_ENGINES)}, or 'all', or a comma list of them")
    if len(set(names)) != len(names):
        raise ValueError(f"engine listed twice in {spec!r}")
    return names


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def check_settings(max_num_seqs: int, max_num_batched_tokens: int | None, max_model_len: int | None,
                   rate: float | None) -> None:
    def positive(name, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    positive("max_num_seqs", max_num_seqs)
    if max_num_batched_tokens is not None:
        positive("max_num_batched_tokens (the token budget: at least one token)", max_num_batched_tokens)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is smaller than max_num_seqs="
                             f"{max_num_seqs}: one step's decodes alone need {max_num_seqs} tokens")
    if max_model_len is not None:
        positive("max_model_len", max_model_len)
    if rate is not None and (not math.isfinite(rate) or rate < 0):
        raise ValueError(f"request rate must be >= 0 requests per second (0 = offline), got {rate!r}")


def run_minillm(engine: str | EngineConfig, workload: Workload, weights, tokenizer, *,
                progress: bool = False, **options: Any) -> RunResult:
    """One minillm engine on ``workload``; arrivals are replayed in real time.

    ``engine``: an ``EngineConfig``, or an engine name with ``options`` (EngineConfig fields).
    """
    from minillm.engine import build_engine
    from minillm.sampling_params import SamplingParams

    cfg = engine if isinstance(engine, EngineConfig) else EngineConfig(engine=engine, **options)
    eng = build_engine(cfg, weights=weights, tokenizer=tokenizer)
    # Warm up (first-call allocations), outside the measurement.
    eng.run([eng.make_request([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=2), request_id="warmup")])
    eng.step_records.clear()
    if eng.speculator is not None:
        eng.speculator.reset_stats()
    if hasattr(eng.runner, "reset_counts"):  # tensor parallel: count the workload's steps only
        eng.runner.reset_counts()
    start = time.perf_counter()
    reqs = [eng.make_request(r.prompt_token_ids, r.sampling_params(), arrival_time=start + r.arrival_time,
                             request_id=r.request_id) for r in workload]
    try:
        outs = eng.run(reqs, use_tqdm=progress)
    finally:
        eng.close()  # a tensor-parallel engine's workers stop here
    result = RunResult(cfg.engine, [r.metrics for r in reqs], [o.token_ids for o in outs], list(eng.step_records), start,
                       max(r.metrics.finish_time for r in reqs), cfg.max_num_seqs, eng.resolved.kv_cache_bytes,
                       [r.num_prompt_tokens for r in reqs])
    result.extra.update(run_extra(eng))
    if eng.spec_stats is not None:  # acceptance_rate, mean_accepted_tokens, tokens_per_target_forward, ...
        result.extra.update(eng.spec_stats.as_dict())
    return result


# -- the paged KV cache's options ---------------------------------------------------------

def check_paged_settings(block_size: int, num_blocks: int | None, attention_backend: str | None) -> None:
    """Fail before any weight loads: a power-of-two block size, num_blocks >= 1, a known backend."""
    from minillm.config import ATTENTION_BACKENDS

    if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
            or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {block_size!r}")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_blocks must be an integer >= 1 (blocks of block_size tokens), got {num_blocks!r}")
    if attention_backend is not None and attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {attention_backend!r}")


def paged_options(engine: str, block_size: int = 16, num_blocks: int | None = None,
                  attention_backend: str | None = None) -> dict[str, Any]:
    """EngineConfig options of a minillm engine: the attention backend for every engine, the
    block size and count for the paged one (contiguous engines reserve max_model_len per slot)."""
    opts: dict[str, Any] = {} if attention_backend is None else {"attention_backend": attention_backend}
    if engine == "paged":
        opts.update(block_size=block_size, num_blocks=num_blocks)
    return opts


def run_extra(eng) -> dict[str, Any]:
    """What a minillm run records about its KV cache and weights: the attention backend, the
    quantization where there is one; blocks if paged."""
    rc = eng.resolved
    out: dict[str, Any] = {"attention_backend": rc.placement.attention_backend}
    if rc.quantization:
        out["quantization"] = rc.quantization
    if rc.engine == "paged":
        out.update(block_size=rc.block_size, num_blocks=rc.num_blocks)
    counts = getattr(eng.runner, "counts", None)
    if counts is not None:  # tensor parallel: rank 0's step time split into compute and communication
        out["tensor_parallel"] = counts()
    return out


def check_chunked_prefill(engines: Sequence[str], enable_chunked_prefill: bool) -> None:
    """The flag is the paged scheduler's policy; vLLM's scheduler always mixes prompt chunks into
    decode steps, so ``--engine paged,vllm`` with it compares the same policy side by side."""
    if enable_chunked_prefill and any(name not in ("paged", "vllm") for name in engines):
        raise ValueError("--enable-chunked-prefill is a policy of the paged scheduler: run it with --engine paged "
                         f"(or paged,vllm: vLLM always chunks), got {', '.join(engines)}")


def check_peer_weights(engines: Sequence[str], dummy_weights: bool) -> None:
    """llama.cpp reads the model's GGUF itself: it has no dummy weights to compare with."""
    if dummy_weights and "llamacpp" in engines:
        raise ValueError("--dummy-weights cannot run with llamacpp: llama.cpp reads the real GGUF only "
                         "(drop --dummy-weights, or the llamacpp engine)")


def check_paged_only(engines: Sequence[str], flag: str, on: bool) -> None:
    """A paged-engine option (``flag``) given with an engine list that has another engine in it."""
    if on and any(name != "paged" for name in engines):
        raise ValueError(f"{flag} is an option of the paged engine: run it with --engine paged "
                         f"(got {', '.join(engines)})")


def check_speculative(engines: Sequence[str], speculative: dict | None) -> None:
    """Validate the speculative option before any weight loads (it applies to the paged engine)."""
    if speculative is None:
        return
    from minillm.config import SpeculativeConfig

    SpeculativeConfig.from_dict(speculative)
    if "paged" not in engines:
        raise ValueError("--speculative runs in the paged engine: include paged in --engine "
                         f"(got {', '.join(engines)})")


def parse_layers(spec: str) -> list[int]:
    """'0-7' or '0,2,4' or '0-11,18-29' -> layer indices."""
    out: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise ValueError(f"--draft-layers wants indices and ranges like 0-7 or 0,2,4, got {spec!r}") from None
    return out


def run_benchmark(engines: Sequence[str], workload: Workload, *, max_num_seqs: int = 8,
                  max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                  dummy_weights: bool = False, progress: bool = True,
                  on_result: Callable[[RunResult], None] | None = None,
                  block_size: int = 16, num_blocks: int | None = None,
                  attention_backend: str | None = None, enable_chunked_prefill: bool = False,
                  speculative: dict | None = None, enable_prefix_caching: bool = False,
                  scheduling_policy: str = "fcfs", queue_timeouts: dict | None = None,
                  dtype: str | None = None, threads: int | None = None,
                  vllm_enforce_eager: bool = False, compile: bool = False,
                  quantization: str | None = None, llamacpp_parallel: int | None = None,
                  tensor_parallel_size: int = 1) -> list[RunResult]:
    """Run ``engines`` one after the other on ``workload`` in this process (vllm, llamacpp in a subprocess).

    ``speculative`` (the ``LLM(speculative=...)`` dict), ``enable_prefix_caching`` and
    ``scheduling_policy`` apply to the paged engine; ``queue_timeouts`` to every minillm
    engine's per-class report. ``dtype`` (None: the device's) is every engine's dtype.
    ``compile``: every minillm engine runs its steps as one compiled graph (``EngineConfig.compile``);
    its warm-up request compiles it, outside the measurement. ``quantization``: every minillm
    engine's weights (``EngineConfig.quantization``; the baselines keep float weights).
    ``llamacpp_parallel``: llama.cpp's parallel slots (None: $MINILLM_LLAMACPP_PARALLEL, else 1).
    ``tensor_parallel_size``: every minillm engine split over that many processes
    (``EngineConfig.tensor_parallel_size``)."""
    from minillm import loader

    check_settings(max_num_seqs, max_num_batched_tokens, max_model_len, None)
    check_paged_settings(block_size, num_blocks, attention_backend)
    engines = parse_engines(",".join(engines))
    check_chunked_prefill(engines, enable_chunked_prefill)
    check_speculative(engines, speculative)
    check_paged_only(engines, "--enable-prefix-caching", enable_prefix_caching)
    check_paged_only(engines, "--scheduling-policy priority", scheduling_policy != "fcfs")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_peer_weights(engines, dummy_weights)
    vllm_python = find_vllm_python() if "vllm" in engines else None
    llamacpp_python = find_llamacpp_python() if "llamacpp" in engines else None
    if threads is None:  # the peers' thread count: torch's now, before an engine's governor changes it
        import torch
        threads = torch.get_num_threads()
    from minillm.config import ModelConfig
    from minillm.resolve import resolve

    # Resolve every engine's configuration now: a bad option fails before any weight loads.
    L = max_model_len or workload.default_max_model_len()
    configs = {name: EngineConfig(engine=name, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=L, dummy_weights=dummy_weights, dtype=dtype,
                                  enable_chunked_prefill=enable_chunked_prefill and name == "paged",
                                  speculative=speculative if name == "paged" else None,
                                  enable_prefix_caching=enable_prefix_caching and name == "paged",
                                  scheduling_policy=scheduling_policy if name == "paged" else "fcfs",
                                  queue_timeouts=queue_timeouts, compile=compile, quantization=quantization,
                                  tensor_parallel_size=tensor_parallel_size, **paged_options(name, block_size, num_blocks, attention_backend))
               for name in MINILLM_ENGINES}
    mcfg = ModelConfig()
    for name in engines:
        if name in configs:
            resolve(configs[name], mcfg)
    budget = resolve(configs["continuous"], mcfg).max_num_batched_tokens  # the baselines' budget, as minillm's
    longest_prompt = max(len(r.prompt_token_ids) for r in workload)
    if (longest_prompt > budget and not enable_chunked_prefill) or longest_prompt >= L:
        raise ValueError(f"the workload's longest prompt has {longest_prompt} tokens: it needs "
                         f"max_num_batched_tokens >= {longest_prompt} and max_model_len > {longest_prompt}")
    if "llamacpp" in engines:
        check_context(workload, L)
    weights = tokenizer = hf_model = None
    results = []
    for name in engines:
        if name in MINILLM_ENGINES:
            if weights is None:
                if dummy_weights:
                    weights = loader.dummy_weights(mcfg)
                else:
                    weights, tokenizer = loader.load_weights(), loader.load_tokenizer()
            res = run_minillm(configs[name], workload, weights, tokenizer, progress=progress)
            res.extra["dtype"] = _dtype_name(resolve(configs[name], mcfg).placement.dtype)
        elif name == "vllm":
            place = resolve(configs["continuous"], mcfg).placement
            # The KV memory of minillm's contiguous engine: max_num_seqs regions of max_model_len tokens.
            kv_bytes = max_num_seqs * L * mcfg.kv_bytes_per_token(place.dtype.itemsize)
            res = run_vllm(workload, model_dir=vllm_model_dir(dummy_weights), dtype=_dtype_name(place.dtype),
                           max_num_seqs=max_num_seqs, max_model_len=L, max_num_batched_tokens=budget,
                           kv_cache_memory_bytes=kv_bytes, python=vllm_python, threads=threads,
                           enforce_eager=vllm_enforce_eager, skip_tokenizer_init=dummy_weights, progress=progress)
            res.extra["dtype"] = res.extra["vllm_dtype"] or _dtype_name(place.dtype)
        elif name == "llamacpp":
            gguf = loader.find_gguf()
            res = run_llamacpp(workload, gguf_path=gguf, threads=threads, n_ctx=L, python=llamacpp_python,
                               progress=progress, parallel=llamacpp_parallel)
            res.extra["dtype"] = gguf_weight_types(gguf)
        else:
            from minillm.bench import hf_baselines
            if hf_model is None:
                if dummy_weights:
                    hf_model = loader.hf_model_from_weights(weights or loader.dummy_weights(mcfg), mcfg)
                else:
                    hf_model = loader.load_hf_model()
                # A fair baseline runs where minillm runs and in its dtype (bf16 on a GPU):
                # the placement minillm resolved, not transformers' CPU/fp32 default.
                place = resolve(configs["continuous"], mcfg).placement
                hf_model = hf_model.to(device=place.device, dtype=place.dtype)
            pad = hf_model.config.eos_token_id if hf_model.config.pad_token_id is None else hf_model.config.pad_token_id
            pad = pad[0] if isinstance(pad, list) else pad
            if name == "hf-generate":
                res = hf_baselines.run_hf_generate(hf_model, workload, max_num_seqs, pad, progress=progress)
            else:
                res = hf_baselines.run_hf_continuous(hf_model, workload, max_num_seqs, budget, L, pad,
                                                     progress=progress)
            res.extra["dtype"] = _dtype_name(hf_model.dtype)
        res.extra.update(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=L,
                         enable_chunked_prefill=enable_chunked_prefill)
        if name == "vllm":  # what vLLM ran with (its V1 scheduler chunks long prompts by default)
            res.extra["enable_chunked_prefill"] = res.extra.pop("vllm_enable_chunked_prefill")
        if name == "llamacpp":  # what llama.cpp ran with: its slots (1: one request at a time), its batch
            slots = res.extra["llamacpp_parallel"]
            res.extra.update(max_num_seqs=slots, max_num_batched_tokens=res.extra["llamacpp_n_batch"],
                             enable_chunked_prefill=slots > 1)  # slots split a prompt across steps
        if name in configs:
            cfg = configs[name]
            res.extra.update(enable_prefix_caching=cfg.enable_prefix_caching,
                             scheduling_policy=cfg.scheduling_policy, queue_timeouts=dict(cfg.queue_timeouts),
                             compile=cfg.compile)
        results.append(res)
        if on_result:
            on_result(res)
    return results


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def same_tokens(results: Sequence[RunResult]) -> list[float]:
    """For each run, the fraction of requests whose tokens equal the first run's."""
    ref = results[0].output_token_ids
    return [sum(a == b for a, b in zip(ref, r.output_token_ids)) / len(ref) for r in results]


def first_differences(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> list[int | None]:
    """Per request, the index of the first output token that differs from ``ref`` (None: equal).

    Greedy runs in a low-precision dtype part where two tokens are nearly tied; how late
    they part says more than whether they do."""
    out: list[int | None] = []
    for a, b in zip(ref, got):
        if list(a) == list(b):
            out.append(None)
        else:
            out.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minillm bench",
        description="Run one seeded workload through several engines side by side and compare "
                    "throughput, latency, slot utilization and KV memory.")
    p.add_argument("--engine", default="continuous",
                   help=f"one of {', '.join(BENCH_ENGINES)}; 'all' (all but the peers {', '.join(PEER_ENGINES)}); "
                        "or a comma list (default: continuous)")
    p.add_argument("--workload", default="skewed", choices=list(WORKLOADS), help="length mix (default: skewed)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=8, help="B: batch slots (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: max_model_len)")
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="paged engine: decodes first, then prompt chunks within the token budget "
                        "(default: a step is all-prefill or all-decode; vLLM always chunks)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="KV region per slot (default: longest request rounded up to 256)")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals at this many requests/s; 0 = offline, all at t=0 (default)")
    p.add_argument("--workload-param", action="append", default=[], metavar="KEY=VALUE",
                   help="tune the length mix, e.g. long_tokens=400 (repeatable)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, vLLM's and llama.cpp's too (default: torch's choice)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="dtype of every engine, minillm, transformers and vLLM (default: the device's, "
                        "float32 on the CPU, bfloat16 on CUDA); llama.cpp runs the GGUF's own types")
    p.add_argument("--dummy-weights", action="store_true", help="seeded random weights with the real config")
    p.add_argument("--compile", action="store_true",
                   help="minillm engines run each step as one graph compiled by torch.compile (CPU, torch attention); "
                        "compiling takes about a minute, before the measurement")
    p.add_argument("--quantization", choices=["int8", "q4"], default=None,
                   help="minillm engines with weight-only quantized linear layers and LM head (CPU, float32); "
                        "transformers and vLLM keep float weights")
    p.add_argument("--llamacpp-parallel", type=int, default=None, metavar="P",
                   help="llama.cpp's parallel slots, as llama-server -np P: continuous batching of P sequences "
                        "(default: $MINILLM_LLAMACPP_PARALLEL, else 1, one request at a time)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="minillm engines split over N processes on torch.distributed (gloo on the CPU): "
                        "each rank runs on the cores / N threads")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("paged KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block of the paged engine (default 16)")
    g.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks of the paged engine (default: the contiguous engine's bytes, "
                         "max_num_seqs x max_model_len tokens)")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default=None,
                    help="attention of the minillm engines (default: triton on CUDA; on the CPU cpu, or torch "
                         "where no C++ compiler is installed)")
    s = p.add_argument_group("speculative decoding (paged engine)")
    s.add_argument("--speculative", choices=["ngram", "model", "medusa"], default=None,
                   help="drafter: prompt lookup, a self-draft made of --draft-layers of the model, or Medusa heads")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k, tokens drafted per step (default 4; with --medusa-tree the tree's nodes)")
    s.add_argument("--medusa-heads", default=None, help="Medusa heads file (default: the shipped one)")
    s.add_argument("--medusa-tree", action="store_true",
                   help="Medusa drafts a candidate tree (spec_decode/tree.py MEDUSA_TREE) instead of a chain")
    s.add_argument("--acceptance", choices=["exact", "typical"], default="exact",
                   help="Medusa's acceptance rule (default exact; typical: Medusa-2's, not exact when sampling)")
    s.add_argument("--draft-layers", default="0-7", help="layers of the model drafter (default 0-7)")
    s.add_argument("--draft-quantization", choices=["int8", "q4"], default=None,
                   help="the model drafter alone with quantized weights (CPU, float32)")
    s.add_argument("--spec-disable-by-batch-size", type=int, default=4,
                   help="speculate only while fewer requests run (default 4; 0 = always)")
    c = p.add_argument_group("many users (paged engine, chapter 6)")
    c.add_argument("--enable-prefix-caching", action="store_true",
                   help="share the KV blocks of equal prompt prefixes (hash-chained full blocks, LRU eviction)")
    c.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs (default) or priority: classes interactive > standard > batch, queue timeouts")
    c.add_argument("--queue-timeout", action="append", default=[], metavar="CLASS=SECONDS",
                   help="queue timeout of a priority class, e.g. interactive=0.05 (repeatable; "
                        "defaults 0.05 / 0.2 / 1.0 s)")
    v = p.add_argument_group("vLLM side by side (--engine ...,vllm; make peer-vllm)")
    v.add_argument("--vllm-enforce-eager", action="store_true",
                   help="run vLLM without torch.compile (its default compiles the model first: minutes on "
                        "a small CPU, not part of the measured time)")
    return p


@keeps_torch_threads()
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.json:  # written after the whole benchmark: check now that it can be, not minutes later
            import os
            from pathlib import Path

            out = Path(args.json)
            if out.is_dir():
                raise ValueError(f"--json {args.json} is a directory: give a file path, e.g. {out / 'bench.json'}")
            if not out.parent.is_dir():
                raise ValueError(f"--json {args.json}: directory {out.parent} does not exist; create it or give "
                                 f"another path")
            if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
                raise ValueError(f"--json {args.json} is not writable: give another path")
        engines = parse_engines(args.engine)
        check_settings(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len, args.request_rate)
        check_paged_settings(args.block_size, args.num_blocks, args.attention_backend)
        check_chunked_prefill(engines, args.enable_chunked_prefill)
        speculative = None
        if args.speculative:
            speculative = dict(method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                               disable_by_batch_size=args.spec_disable_by_batch_size or None)
            if args.speculative == "model":
                speculative["draft_layers"] = parse_layers(args.draft_layers)
                if args.draft_quantization:
                    speculative["quantization"] = args.draft_quantization
            if args.speculative == "medusa":
                from minillm.spec_decode.tree import MEDUSA_TREE

                speculative.update(heads=args.medusa_heads, acceptance=args.acceptance,
                                   tree=MEDUSA_TREE if args.medusa_tree else None)
        if args.draft_quantization and args.speculative != "model":
            raise ValueError("--draft-quantization quantizes the model drafter: it needs --speculative model")
        if (args.medusa_heads or args.medusa_tree or args.acceptance != "exact") and args.speculative != "medusa":
            raise ValueError("--medusa-heads, --medusa-tree and --acceptance are Medusa's: they need --speculative medusa")
        check_speculative(engines, speculative)
        check_paged_only(engines, "--enable-prefix-caching", args.enable_prefix_caching)
        check_paged_only(engines, "--scheduling-policy priority", args.scheduling_policy != "fcfs")
        if args.dtype is not None or args.attention_backend is not None:
            from minillm import placement  # e.g. bfloat16 with the Triton backend on the CPU: rejected
            placement.resolve(None, args.dtype, args.attention_backend)
        check_peer_weights(engines, args.dummy_weights)
        for peer, find, not_found in (("vllm", find_vllm_python, VllmNotFound),
                                      ("llamacpp", find_llamacpp_python, LlamaCppNotFound)):
            if peer in engines:
                try:
                    find()
                except not_found as e:  # one line, how to get it; no usage text
                    print(f"error: {e}", file=sys.stderr)
                    raise SystemExit(2) from None
        timeouts = {}
        for kv in args.queue_timeout:
            if "=" not in kv:
                raise ValueError(f"--queue-timeout wants CLASS=SECONDS, e.g. interactive=0.05, got {kv!r}")
            k, v = kv.split("=", 1)
            try:
                timeouts[k.strip()] = float(v)
            except ValueError:
                raise ValueError(f"--queue-timeout {kv}: {v!r} is not a number of seconds") from None
        from minillm.config import check_queue_timeouts
        timeouts = check_queue_timeouts(timeouts)
        params = {}
        for kv in args.workload_param:
            if "=" not in kv:
                raise ValueError(f"--workload-param wants KEY=VALUE, got {kv!r}")
            k, v = kv.split("=", 1)
            params[k.strip()] = _parse_value(v.strip())
        llama_slots = llamacpp_runner.llamacpp_parallel(args.llamacpp_parallel) if "llamacpp" in engines else None
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"threads must be an integer >= 1, got {args.threads}")
            import torch
            torch.set_num_threads(args.threads)
        tokenizer = None
        if not args.dummy_weights:
            from minillm import loader
            tokenizer = loader.load_tokenizer()
        workload = make_workload(args.workload, args.num_requests, args.seed, tokenizer,
                                 arrival="poisson" if args.request_rate else "offline",
                                 rate=args.request_rate or None, **params)
    except ValueError as e:
        parser.error(str(e))  # exits with status 2 and the usage line
    print(workload.describe(), file=sys.stderr)
    context = dict(workload=args.workload, seed=args.seed, arrival=workload.arrival, request_rate=workload.rate,
                   workload_params=params, speculative=speculative)
    summaries: list[dict[str, Any]] = []

    def report(res: RunResult) -> None:
        s = summarize(res, **context)
        summaries.append(s)
        print(f"{res.engine}: {s['output_tokens_per_s']:.1f} output tok/s, wall {s['wall_s']:.1f} s",
              file=sys.stderr, flush=True)

    try:
        results = run_benchmark(engines, workload, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=args.max_model_len, dummy_weights=args.dummy_weights,
                                progress=not args.no_progress, on_result=report,
                                block_size=args.block_size, num_blocks=args.num_blocks,
                                attention_backend=args.attention_backend,
                                enable_chunked_prefill=args.enable_chunked_prefill, speculative=speculative,
                                enable_prefix_caching=args.enable_prefix_caching,
                                scheduling_policy=args.scheduling_policy, queue_timeouts=timeouts,
                                dtype=args.dtype, threads=args.threads,
                                vllm_enforce_eager=args.vllm_enforce_eager, compile=args.compile,
                                quantization=args.quantization, llamacpp_parallel=llama_slots,
                                tensor_parallel_size=args.tensor_parallel_size)
    except ValueError as e:
        parser.error(str(e))
    except (VllmFailed, LlamaCppFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for s, frac, res in zip(summaries, same_tokens(results), results):
        s["same_tokens_as"] = {"engine": results[0].engine, "fraction": frac}
        if frac < 1.0:
            s["same_tokens_as"]["first_difference"] = first_differences(results[0].output_token_ids,
                                                                        res.output_token_ids)
    import torch
    for s in summaries:
        s["torch_threads"] = torch.get_num_threads()
    print(format_table(summaries))
    if any(len(s["per_class"]) > 1 for s in summaries):
        print(format_class_table(summaries))
    if args.json:
        payload = summaries[0] if len(summaries) == 1 else {s["engine"]: s for s in summaries}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


__all__ = ["main", "run_benchmark", "run_minillm", "parse_engines", "BENCH_ENGINES", "check_paged_settings",
           "paged_options"]
