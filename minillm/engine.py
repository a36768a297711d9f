"""The step loop, and the vLLM-shaped facade ``LLM``.

    engine.add_request(prompt, params)        text -> token ids -> Request (validated)
    while engine.has_unfinished():
        engine.step()                         schedule -> one forward -> sample -> update

``LLM(engine=...)`` picks the scheduler; everything else (model, runner, sampler,
metrics) is shared by all engines. ``LLM(engine="paged", speculative={...})`` adds a
``Speculator`` (minillm/spec/verify.py): each step drafts tokens, verifies them in the
same one forward and may emit several tokens per request.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from . import device as device_rules
from .block_manager import num_blocks_from_budget
from .config import EngineConfig, ModelConfig
from .metrics import StepRecord, record_step
from .model import build_model
from .model_runner import ModelRunner
from .request import FinishReason, Request, RequestMetrics
from .sampling import SamplingParams, sample
from .scheduler import ContinuousScheduler, PagedScheduler, Scheduler, SchedulerOutput, StaticScheduler


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    metrics: RequestMetrics

    def __repr__(self) -> str:
        return (f"RequestOutput(id={self.request_id}, finish_reason={self.finish_reason}, "
                f"tokens={len(self.token_ids)}, text={self.text[:60]!r})")


class LLMEngine:
    """Owns the model, the KV cache, the scheduler; runs steps."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model, tokenizer,
                 scheduler: Scheduler, runner: ModelRunner, speculator: Any = None):
        self.config = config
        self.model_config = model_config
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.runner = runner
        self.speculator = speculator  # minillm.spec.verify.Speculator, or None
        self.device = runner.device
        self.step_records: list[StepRecord] = []
        self._ids = itertools.count()
        self._seed_counter = itertools.count()
        self.max_model_len = scheduler.max_model_len
        self.scheduler.stop_checker = self._stop_string_hit
        k_cache = runner.kv_caches[0][0]  # [num_blocks, block_size, Hkv, D]
        self.kv_bytes_per_token = runner.kv_cache_bytes // (k_cache.shape[0] * k_cache.shape[1])

    # -- requests -------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token id")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (dummy weights without the GGUF): pass token ids")
            return prompt, list(self.tokenizer(prompt).input_ids)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one character or token id")
        V = self.model_config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {V}); got {bad[:5]}")
        return None, ids

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     arrival_time: float | None = None, request_id: str | None = None) -> Request:
        """Validate and build a Request without touching engine state."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens or raise max_model_len")
        self.check_fits(len(ids))
        rid = str(next(self._ids)) if request_id is None else request_id
        req = Request(rid, ids, params, prompt=text)
        if arrival_time is not None:
            req.arrival_time = req.metrics.arrival_time = arrival_time
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + next(self._seed_counter)
        req.generator = torch.Generator(device=self.device).manual_seed(seed)
        return req

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Reject a prompt the scheduler could never admit (so it cannot stall the queue)."""
        budget = self.scheduler.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and num_prompt_tokens > budget:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens but max_num_batched_tokens is {budget} and "
                "chunked prefill is off: raise max_num_batched_tokens or enable_chunked_prefill=True")
        self.scheduler.check_fits(num_prompt_tokens)  # e.g. the paged cache holds the prompt

    def add_request(self, prompt, params: SamplingParams | None = None, arrival_time: float | None = None,
                    request_id: str | None = None) -> Request:
        req = self.make_request(prompt, params, arrival_time, request_id)
        self.scheduler.add(req)
        return req

    def abort(self, request: Request) -> None:
        self.scheduler.abort(request)
        if self.speculator is not None:
            self.speculator.forget(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------
    def step(self) -> list[Request]:
        """schedule -> forward -> sample -> update. Returns the requests that finished."""
        start = time.perf_counter()
        out: SchedulerOutput = self.scheduler.schedule()
        if not out.rows:  # nothing has arrived yet, or everything waits
            self._idle_wait()
            return []
        if self.speculator is not None:  # draft -> one verifying forward -> 1..k+1 tokens per row
            emitted = self.speculator.step(out)
            device_rules.synchronize(self.device)
            end = time.perf_counter()
            finished = self.speculator.update(out, emitted, now=end)
            num_sampled = len(emitted)
        else:
            logits, sample_rows = self.runner.execute(out.rows)
            reqs = [out.rows[i].request for i in sample_rows]
            tokens = sample(logits, [r.sampling_params for r in reqs], [r.generator for r in reqs])
            device_rules.synchronize(self.device)
            sampled = dict(zip(sample_rows, tokens.tolist()))
            end = time.perf_counter()
            finished = self.scheduler.update(out, sampled, now=end)
            num_sampled = len(sampled)
        for r in finished:
            self._finalize_text(r)
        self.step_records.append(record_step(len(self.step_records), start, end, out, num_sampled,
                                             self.scheduler, self.runner.block_size, self.kv_bytes_per_token))
        return finished

    @property
    def spec_stats(self):
        """Speculation counters (``minillm.spec.verify.SpecStats``), or None without speculation."""
        return None if self.speculator is None else self.speculator.stats

    def _idle_wait(self) -> None:
        waiting = self.scheduler.waiting
        if waiting and not self.scheduler.running:
            delay = waiting[0].arrival_time - time.perf_counter()
            if delay > 0:
                time.sleep(min(delay, 0.05))

    # -- text -------------------------------------------------------------------
    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _stop_string_hit(self, r: Request) -> bool:
        text = self.decode(r.output_token_ids)
        return any(s in text for s in r.sampling_params.stop)

    def _finalize_text(self, r: Request) -> None:
        text = self.decode(r.output_token_ids)
        cut = [text.find(s) for s in r.sampling_params.stop if s in text]
        r.output_text = text[:min(cut)] if cut else text  # a stop string is not part of the output

    def output(self, r: Request) -> RequestOutput:
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, r.output_text,
                             list(r.output_token_ids), r.finish_reason, r.metrics)

    def run(self, requests: list[Request], use_tqdm: bool = False) -> list[RequestOutput]:
        """Add ``requests`` (already validated) and step until all have finished."""
        for r in requests:
            self.scheduler.add(r)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=sum(r.sampling_params.max_tokens for r in requests), unit="tok",
                       desc=f"{self.config.engine} engine")
        try:
            while self.has_unfinished():
                before = sum(r.num_output_tokens for r in requests) if bar else 0
                self.step()
                if bar:
                    bar.update(sum(r.num_output_tokens for r in requests) - before)
        except BaseException:
            for r in requests:  # leave the engine clean: no half-run request keeps KV space
                if not r.is_finished:
                    self.abort(r)
            raise
        finally:
            if bar:
                bar.close()
        return [self.output(r) for r in requests]


# -- engine registry ------------------------------------------------------------

SchedulerFactory = Callable[[EngineConfig, ModelConfig, int, int], tuple[Scheduler, int, int]]


def _continuous(cfg: EngineConfig, mcfg: ModelConfig, max_model_len: int, budget: int):
    seqs = 1 if cfg.engine == "simple" else cfg.max_num_seqs
    sched = ContinuousScheduler(seqs, budget, max_model_len, mcfg.eos_token_id)
    return sched, seqs, max_model_len  # KV: one block of max_model_len tokens per batch slot


def _static(cfg: EngineConfig, mcfg: ModelConfig, max_model_len: int, budget: int):
    sched = StaticScheduler(cfg.max_num_seqs, budget, max_model_len, mcfg.eos_token_id)
    return sched, cfg.max_num_seqs, max_model_len  # the same contiguous slots as continuous


def _paged(cfg: EngineConfig, mcfg: ModelConfig, max_model_len: int, budget: int):
    # Size the cache in blocks from whichever budget was given (default: the bytes the
    # contiguous engine reserves). One block of one token costs K and V in every layer.
    dtype = device_rules.resolve(cfg.device, cfg.dtype, cfg.attention_backend).dtype
    num_blocks = num_blocks_from_budget(
        block_size=cfg.block_size, max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs,
        kv_bytes_per_token=mcfg.kv_bytes_per_token(dtype.itemsize),
        num_blocks=cfg.num_blocks, kv_cache_bytes=cfg.kv_cache_bytes)
    sched = PagedScheduler(cfg.max_num_seqs, budget, max_model_len, mcfg.eos_token_id, num_blocks,
                           cfg.block_size, enable_chunked_prefill=cfg.enable_chunked_prefill)
    return sched, num_blocks, cfg.block_size


SCHEDULERS: dict[str, SchedulerFactory] = {"simple": _continuous, "static": _static, "continuous": _continuous,
                                           "paged": _paged}


def build_engine(config: EngineConfig, weights: dict | None = None, tokenizer: Any = "auto",
                 model_config: ModelConfig | None = None) -> LLMEngine:
    """An engine for ``config``. ``model_config`` (with ``weights``, else seeded dummy ones)
    builds another Llama than the GGUF's, e.g. a tiny one for fast tests."""
    from . import loader

    if config.engine not in SCHEDULERS:
        raise ValueError(f"engine {config.engine!r} is not available; valid engines: {', '.join(SCHEDULERS)}")
    place = device_rules.resolve(config.device, config.dtype, config.attention_backend)
    if model_config is not None:
        mcfg = model_config
        weights = loader.dummy_weights(mcfg, config.seed) if weights is None else weights
    elif config.dummy_weights:
        mcfg = loader.read_config(config.model) if _gguf_present(config.model) else ModelConfig()
        weights = loader.dummy_weights(mcfg, config.seed) if weights is None else weights
    else:
        mcfg = loader.read_config(config.model)
        weights = loader.load_weights(config.model) if weights is None else weights
    if tokenizer == "auto":
        tokenizer = loader.load_tokenizer(config.model) if _gguf_present(config.model) else None
    max_model_len = config.max_model_len or mcfg.max_position_embeddings
    if max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len must be at most the model's context length "
                         f"{mcfg.max_position_embeddings}, got {max_model_len}")
    budget = config.max_num_batched_tokens or max(max_model_len, config.max_num_seqs)
    sched, num_blocks, block_size = SCHEDULERS[config.engine](config, mcfg, max_model_len, budget)
    model = build_model(mcfg, weights, place.device, place.dtype, place.attention_backend)
    runner = ModelRunner(model, mcfg, num_blocks, block_size, place.device, place.dtype)
    speculator = None
    if config.speculative is not None:
        from .spec.drafters import build_drafter
        from .spec.verify import Speculator

        drafter = build_drafter(config.speculative, model, num_blocks, block_size, place.device, place.dtype)
        speculator = Speculator(config.speculative, drafter, runner, sched)
    return LLMEngine(config, mcfg, model, tokenizer, sched, runner, speculator)


def _gguf_present(path) -> bool:
    from . import loader

    try:
        loader.find_gguf(path)
        return True
    except loader.ModelFileNotFound:
        return False


class LLM:
    """vLLM-shaped entry point.

    >>> llm = LLM()                                    # the real SmolLM2, simple engine
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].text
    """

    def __init__(self, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(**kwargs)
        self.engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Iterable[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is validated before any runs."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts: "
                                 "give one, or one per prompt")
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        return self.engine.run(requests, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("chat needs the tokenizer of the GGUF, which this engine does not have")
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if not isinstance(enc, list) else enc
        return list(ids)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the chat template, then generate. One conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.chat_prompt(c) for c in convs], sampling_params, use_tqdm)
