"""The step loop, and the vLLM-shaped facade ``LLM``.

    engine.add_request(prompt, params)        text -> token ids -> Request (validated)
    while engine.has_unfinished():
        engine.step()                         schedule -> forward -> sample -> update

Every engine is this one loop; ``LLM(engine=...)`` picks the scheduler (``scheduler/``).
With ``speculative={...}`` (paged engine) the same step also drafts tokens into the
lookahead the scheduler reserved and verifies them in its one forward
(``spec/speculator.py``), emitting up to k + 1 tokens per request.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .clock import WallClock
from .config import EngineConfig, ModelConfig, ResolvedConfig
from .inputs import parse_conversation, parse_messages, parse_prompts
from .metrics import EngineSnapshot, OffloadSnapshot, StepRecord, count_classes, record_step
from .model import build_model
from .model_runner import ModelOutput, ModelRunner
from .request import FinishReason, Request, RequestMetrics
from .resolve import resolve
from .sampling import sample_at
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput, build_scheduler
from .slo import SloController
from .threads import make_governor


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
    """Owns the scheduler and the runner (model + KV cache); runs steps."""

    def __init__(self, config: EngineConfig, resolved: ResolvedConfig, model_config: ModelConfig, tokenizer,
                 scheduler: Scheduler, runner: Any, speculator: Any = None, clock: Any = None):
        self.config = config
        self.resolved = resolved
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.runner = runner  # ModelRunner, or the simulator's cost-model runner
        self.model = getattr(runner, "model", None)
        self.speculator = speculator  # minillm.spec_decode.speculator.Speculator, or None
        self.clock = clock or WallClock()
        scheduler.clock = self.clock.now
        self.device = resolved.placement.device
        self.max_model_len = resolved.max_model_len
        self.kv_bytes_per_token = resolved.kv_bytes_per_token
        self.step_records: list[StepRecord] = []
        # The SLO controller (minillm/slo.py): moves the token budget after steps; None when off.
        self.slo_controller = (None if config.slo is None else
                               SloController(config.slo, scheduler, config.engine, resolved.max_model_len))
        self._empty_steps = 0  # consecutive steps that scheduled nothing with requests ready (livelock check)
        self._ids = itertools.count()
        self._seed_counter = itertools.count()
        # CPU threads that follow the cores other programs leave free (threads.py); None on
        # CUDA, with a fixed count, and for the simulator's cost-model runner. A compiled
        # step keeps one count: torch guards its graph on the thread count, and every new
        # count would compile the step again (a minute for SmolLM2, inside a step).
        threads = None if config.compile and config.cpu_threads == "auto" else config.cpu_threads
        if config.tensor_parallel_size > 1:  # each rank keeps its share of the cores (distributed/runner.py)
            threads = None
        self.threads = make_governor(threads, self.device) if self.model is not None else None

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
        arrival = self.clock.now() if arrival_time is None else arrival_time
        req = Request(rid, ids, params, prompt=text, arrival_time=arrival)
        # The request's seed; the noise of the token at position p is drawn from (seed, p)
        # (``sampling.position_noise``), with ``generator`` as scratch space re-seeded per draw.
        req.seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + next(self._seed_counter)
        req.generator = torch.Generator(device=self.device)
        if self.tokenizer is not None:
            from .detokenizer import IncrementalDetokenizer

            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
        return req

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Reject a prompt the scheduler could never admit (so it cannot stall the queue)."""
        budget = self.scheduler.max_num_batched_tokens
        if self.slo_controller is not None:  # the budget it may give back, not the one it holds now
            budget = self.slo_controller.max_budget
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
        """Stop ``request`` now: its KV space is freed, its output keeps what it has so far."""
        was_finished = request.is_finished
        self.scheduler.abort(request)
        if self.speculator is not None:
            self.speculator.forget(request)
        if not was_finished:
            self._finish_text(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------
    def step(self) -> list[Request]:
        """schedule -> (propose drafts) -> forward -> sample or verify -> update. Returns finished requests."""
        if self.threads is not None:
            self.threads.tick()
        start = self.clock.now()
        out: SchedulerOutput = self.scheduler.schedule()
        if not out.rows:  # nothing has arrived yet, or everything waits
            self._check_progress()
            self._idle_wait()
            return []
        self._empty_steps = 0
        if self.speculator is not None:
            self.speculator.propose(out)  # drafts, into the lookahead the scheduler reserved
        model_out = self.runner.execute(out)  # logits, laid out as the batch was built
        emitted = self.sample(out, model_out)  # row index -> its tokens (1, or up to k + 1)
        if self.speculator is not None and self.speculator.kv_moves:  # a tree's accepted path, where it now sits
            self.runner.move_kv(self.speculator.take_kv_moves())
        end = self.clock.now()
        finished = self.scheduler.update(out, emitted, now=end)
        if self.speculator is not None:
            self.speculator.finish_step(out, finished)
        for r in finished:
            self._finish_text(r)
        self.step_records.append(record_step(len(self.step_records), start, end, out, len(emitted), self.scheduler,
                                             self.resolved.block_size, self.kv_bytes_per_token))
        if self.slo_controller is not None:  # this step's tokens into its window; maybe a new budget
            self.slo_controller.after_step([row.request for row in out.rows], end)
        return finished

    def sample(self, out: SchedulerOutput, model_out: ModelOutput) -> dict[int, list[int]]:
        """One token per sampling row; with speculation, the verified drafts and one more."""
        if self.speculator is not None:
            return self.speculator.verify(out, model_out)
        reqs = [out.rows[i].request for i in model_out.rows]
        # Each token lands at index r.num_tokens of its request: its noise comes from there.
        tokens = sample_at(model_out.logits, [r.sampling_params for r in reqs], [r.seed for r in reqs],
                           [r.num_tokens for r in reqs], [r.generator for r in reqs], model_out.sampling_table)
        return {i: [t] for i, t in zip(model_out.rows, tokens.tolist())}  # .tolist(): the step's one host read

    @property
    def spec_stats(self):
        """Speculation counters (``minillm.spec_decode.speculator.SpecStats``), or None without speculation."""
        return None if self.speculator is None else self.speculator.stats

    def _check_progress(self) -> None:
        """An empty step is normal once (e.g. right after a request preempted itself) or while
        nothing has arrived; the same empty step over and over with requests ready is a
        livelock: nothing will ever free a slot or a block (a leaked block, a policy that
        never schedules). Raise then, rather than spin forever."""
        sched = self.scheduler
        ready = sched.running or (sched.waiting and sched.arrived(sched.waiting[0], self.clock.now()))
        self._empty_steps = self._empty_steps + 1 if ready else 0
        if self._empty_steps > self.MAX_EMPTY_STEPS:
            bm = sched.block_manager
            raise RuntimeError(
                f"no progress: {self._empty_steps} steps in a row scheduled nothing while {len(sched.running)} "
                f"requests run and {len(sched.waiting)} wait ({bm.num_free_blocks} of {bm.num_blocks} KV blocks "
                f"free). Nothing can free a slot or a block: a leaked block, or a scheduling policy that "
                f"never schedules a ready request?")

    MAX_EMPTY_STEPS = 8

    def _idle_wait(self) -> None:
        waiting = self.scheduler.waiting
        if waiting and not self.scheduler.running:
            self.clock.wait_until(waiting[0].arrival_time)

    # -- text -------------------------------------------------------------------
    def close(self) -> None:
        """Stop what runs beside this process (a tensor-parallel engine's workers); a no-op otherwise."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _finish_text(self, r: Request) -> None:
        """The final text: built incrementally, stop string (and stop token text) left out."""
        if r.detokenizer is None:
            return
        last = r.output_token_ids[-1] if r.output_token_ids else None
        stopped_on_token = (r.finish_reason is FinishReason.STOP and last is not None
                            and last in r.sampling_params.stop_token_ids)
        r.output_text = r.detokenizer.finish(r.finish_reason, stopped_on_token)

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

    def snapshot(self) -> EngineSnapshot:
        """The engine's state now, as plain numbers: what ``AsyncLLM``, the server's
        ``/metrics`` and the dashboard read. Cheap (no tensor is touched); safe to call from
        another thread while the engine steps (the queues are copied before they are counted)."""
        s = self.scheduler
        bm = s.block_manager
        records = self.step_records
        try:
            last = records[-1]
        except IndexError:  # no step yet (or trimmed to nothing by another thread meanwhile)
            last = None
        spec = self.spec_stats
        running, waiting = list(s.running), list(s.waiting)
        return EngineSnapshot(
            time=self.clock.now(), num_steps=len(records), num_running=len(running), num_waiting=len(waiting),
            running_by_class=count_classes(running), waiting_by_class=count_classes(waiting),
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_blocks, num_preemptions=s.num_preemptions, preemptions_owner=id(s),
            last_step_rows=0 if last is None else last.num_rows, last_step_end=None if last is None else last.end,
            spec_num_drafts=None if spec is None else spec.num_drafts,
            spec_num_accepted=None if spec is None else spec.num_accepted,
            spec_acceptance_rate=None if spec is None else spec.acceptance_rate,
            spec_owner=None if spec is None else id(spec),
            slo=None if self.slo_controller is None else self.slo_controller.snapshot(),
            kv_offload=self._offload_snapshot())

    def _offload_snapshot(self) -> OffloadSnapshot | None:
        host, pool = self.scheduler.block_manager.host, getattr(self.runner, "host_kv", None)
        if host is None or pool is None:
            return None
        s = self.scheduler
        return OffloadSnapshot(
            host_blocks_total=host.num_blocks, host_blocks_used=host.num_used, blocks_out=pool.blocks_out,
            blocks_in=pool.blocks_in, bytes_out=pool.bytes_out, bytes_in=pool.bytes_in, copy_seconds=pool.seconds,
            device_hit_tokens=s.prefix_hit_tokens - s.host_hit_tokens, host_hit_tokens=s.host_hit_tokens)


# -- building an engine -----------------------------------------------------------

def build_engine(config: EngineConfig, weights: dict | None = None, tokenizer: Any = "auto",
                 model_config: ModelConfig | None = None) -> LLMEngine:
    """An engine for ``config``. ``model_config`` (with ``weights``, else seeded dummy ones)
    builds another Llama than the GGUF's, e.g. a tiny one for fast tests."""
    from . import loader

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
    rc = resolve(config, mcfg)
    place = rc.placement
    if place.attention_backend == "cpu":  # build the C++ library now (once per machine), not in the first step
        from .kernels.cpu import build

        build.library()
    scheduler = build_scheduler(config, rc, mcfg.eos_token_id)
    if config.tensor_parallel_size > 1:
        return _tensor_parallel_engine(config, rc, mcfg, weights, tokenizer, scheduler)
    model = build_model(mcfg, weights, place.device, place.dtype, place.attention_backend, rc.pack_weights)
    if rc.quantization:
        from .quantization import quantize_model

        source = model
        if place.device.type != "cpu" or place.dtype != torch.float32:
            # Quantize the float32 weights (the file's own grids), not the device's rounded copies.
            source = build_model(mcfg, weights, torch.device("cpu"), torch.float32, "torch", False)
        quantize_model(model, rc.quantization, source=source)
        del source
    runner = ModelRunner(model, mcfg, rc.num_blocks, rc.block_size, place.device, place.dtype,
                         compile=rc.compile)
    if config.kv_offload is not None:
        runner.enable_host_kv(config.kv_offload["host_blocks"])
    if place.device.type == "cuda" and place.attention_backend == "triton":
        # Compile every Triton variant this engine can reach now, so that no compile
        # (seconds each) lands inside a timed run or a user's first request.
        from .kernels import warmup

        warmup(mcfg, place.dtype, rc.block_size, place.device, max_num_seqs=rc.max_num_seqs,
               max_model_len=rc.max_model_len, progress=True, quantization=rc.quantization)
    if config.cuda_graphs:  # validated by resolve(): CUDA and the Triton backend
        runner.capture_cuda_graphs(rc.max_num_seqs, rc.max_model_len)
    speculator = _speculator(config, rc, model)
    runner.keep_hidden = config.speculative is not None and config.speculative.method == "medusa"
    return LLMEngine(config, rc, mcfg, tokenizer, scheduler, runner, speculator)


def _speculator(config: EngineConfig, rc, target):
    """The speculator of ``config.speculative`` drafting for ``target`` (None: no speculation)."""
    if config.speculative is None:
        return None
    from .spec_decode.drafters import build_drafter
    from .spec_decode.speculator import Speculator

    place = rc.placement
    drafter = build_drafter(config.speculative, target, rc.num_blocks, rc.block_size, place.device, place.dtype)
    return Speculator(config.speculative, drafter)


def _tensor_parallel_engine(config: EngineConfig, rc, mcfg: ModelConfig, weights: dict, tokenizer,
                            scheduler) -> LLMEngine:
    """The engine of ``tensor_parallel_size=N``: rank 0's runner (``distributed/runner.py``)
    starts N - 1 worker processes; scheduler, sampler and drafter stay in this process."""
    from .distributed.group import torchrun_rank
    from .distributed.runner import TensorParallelRunner, serve_torchrun_rank
    from .distributed.sharding import check_tensor_parallel

    n, place = config.tensor_parallel_size, rc.placement
    check_tensor_parallel(mcfg, n)
    launched = torchrun_rank()
    if launched is not None:  # every process of a torchrun launch runs this; rank 0 goes on as the engine
        rank, world = launched
        if world != n:
            raise ValueError(f"torchrun started {world} processes but tensor_parallel_size={n}: start {n} "
                             f"(--nnodes x --nproc-per-node)")
        if rank != 0:
            serve_torchrun_rank(rank, mcfg, weights, n, rc.num_blocks, rc.block_size, place.device, place.dtype,
                                place.attention_backend, rc.pack_weights,
                                config.cpu_threads if isinstance(config.cpu_threads, int) else None)
            raise SystemExit(0)  # rank 0 has closed its engine: this worker's work is done
    if place.device.type == "cuda" and n > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (one a rank), but {torch.cuda.device_count()} "
                         f"are visible: lower it, or set CUDA_VISIBLE_DEVICES")
    threads = config.cpu_threads if isinstance(config.cpu_threads, int) else None  # None: the cores / N
    runner = TensorParallelRunner(mcfg, weights, n, rc.num_blocks, rc.block_size, place.device, place.dtype,
                                  place.attention_backend, rc.pack_weights, threads)
    # The drafter runs whole on rank 0: a self-draft takes its layers from an unsplit copy.
    spec = config.speculative
    target = (build_model(mcfg, weights, place.device, place.dtype, place.attention_backend, False)
              if spec is not None and spec.method == "model" else runner.model)
    return LLMEngine(config, rc, mcfg, tokenizer, scheduler, runner, _speculator(config, rc, target))


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

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is validated before any runs.

        ``prompts``: a string, a list of token ids, ``{"prompt": ...}`` or
        ``{"prompt_token_ids": ...}`` (vLLM's shapes), or a list of them.
        """
        prompts = parse_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts: "
                                 "give one, or one per prompt")
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        return self.engine.run(requests, use_tqdm=use_tqdm)

    def close(self) -> None:
        """Stop the worker processes of ``tensor_parallel_size > 1`` now (else at garbage
        collection or exit); a no-op for a one-process engine."""
        self.engine.close()

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """One conversation -> the token ids of the chat template, ready for the assistant's turn."""
        if self.tokenizer is None:
            raise ValueError("chat needs the tokenizer of the GGUF, which this engine does not have")
        messages = parse_conversation(messages)
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if not isinstance(enc, list) else enc
        return list(ids)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the chat template, then generate. One conversation or a list of them."""
        return self.generate([self.chat_prompt(c) for c in parse_messages(messages)], sampling_params, use_tqdm)
