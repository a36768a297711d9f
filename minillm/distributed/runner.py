"""``LLM(tensor_parallel_size=N)``: the model runner of rank 0, and the N - 1 workers it starts.

The engine above does not change: its scheduler, block manager and sampler see one runner
with ``execute(scheduler_output) -> ModelOutput``, as ``model_runner.ModelRunner``. Here
that one call becomes, on every rank at once:

    rank 0: plan the step (model_runner.plan_batch) --broadcast--> ranks 1..N-1
    every rank: its shard's forward, two all-reduces a layer (parallel_model.py)
    rank 0: logits from the (replicated) final hidden states; the engine samples

The workers are processes started with torch.multiprocessing's ``spawn`` (a fresh
interpreter: no forked copy of a notebook's threads). Each gets its shard of the weights,
cut here through the seam ``shard_linear``, and the functions a learner has plugged into
the seams its forward calls (``parallel_mlp``), which it plugs in on its side; those must
live in a module (the exercises file), not in a notebook, to reach another process.

Clean exit: ``close()`` (also on garbage collection and at interpreter exit) broadcasts
the stop and joins the workers, killing any that do not stop. If a step fails on rank 0
(an error, Ctrl-C) or a worker dies, the workers are stopped and the runner refuses
further steps with a clear error: the ranks may be in the middle of different
collectives, and a new ``LLM`` starts clean.
"""
from __future__ import annotations

import os
import pickle
import time
import weakref
from typing import Any

import torch

from .. import seams
from ..config import ModelConfig
from ..model_runner import ModelOutput, allocate_kv_cache, batch_from_plan, kv_cache_bytes, plan_batch
from ..scheduler.output import SchedulerOutput
from .group import Communicator, make_store, torchrun_rank, torchrun_store
from .parallel_model import build_parallel_model
from .sharding import allreduce_bytes_per_step, check_tensor_parallel, shard_weights

WORKER_SEAMS = ("parallel_mlp",)  # seams a worker's forward calls: a plugged function travels to it
STARTUP_TIMEOUT_S = 300.0


class TensorParallelRunner:
    """Rank 0 of ``world_size`` ranks; owns the worker processes."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], world_size: int, num_blocks: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, attention_backend: str,
                 pack_weights: bool, threads: int | None = None):
        check_tensor_parallel(cfg, world_size)
        self.cfg, self.world_size, self.block_size = cfg, world_size, block_size
        self.device, self.dtype = torch.device(device), dtype
        self.graphs = None  # no CUDA graphs across processes (EngineConfig refuses them)
        self.error: str | None = None  # set when the ranks stopped for good
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self._threads_before = torch.get_num_threads()
        if self.device.type == "cpu":  # this process is rank 0: its share of the cores, until close()
            torch.set_num_threads(self.threads)
        plugged = _plugged_for_workers()
        self.torchrun = torchrun_rank() is not None  # the other ranks were started by torchrun, not here
        store = torchrun_store(world_size) if self.torchrun else make_store(0, world_size)
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = []
        for rank in range(1, 1 if self.torchrun else world_size):
            dev = str(_rank_device(self.device, rank))
            p = ctx.Process(target=_worker_entry, daemon=True, name=f"minillm-tp-rank{rank}",
                            args=(rank, world_size, store.port, cfg, shard_weights(cfg, weights, world_size, rank), dev,
                                  dtype, attention_backend, pack_weights, num_blocks, block_size, self.threads,
                                  plugged, os.getpid()))
            p.start()
            self.procs.append(p)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, None)
        self.comm = Communicator(0, world_size, self.device)
        self.model = build_parallel_model(cfg, shard_weights(cfg, weights, world_size, 0), self.comm, self.device,
                                          dtype, attention_backend, pack_weights)
        self.kv_caches = allocate_kv_cache(self.model.cfg, num_blocks, block_size, self.device, dtype)
        self._wait_ready(store)
        self.comm.join(store)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.comm)
        self.store = store
        self.reset_counts()

    # -- what the engine calls (as ModelRunner) --------------------------------------------
    @property
    def kv_cache_bytes(self) -> int:
        """Rank 0's share of the KV cache (its K/V heads); every rank holds one such share."""
        return kv_cache_bytes(self.kv_caches)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        if self.error is not None:
            raise RuntimeError(f"this tensor-parallel engine has stopped ({self.error}); build a new LLM")
        start = time.perf_counter()
        try:
            plan = plan_batch(out.rows, self.block_size)
            self.comm.broadcast_object(plan)
            b = batch_from_plan(plan, self.device)
            hidden = self.model(b.input_ids, b.positions, b.meta, self.kv_caches)  # [T, hidden], whole on every rank
            logits = self.model.compute_logits(hidden[b.logits_index])  # the head is replicated: rank 0 alone
        except BaseException as e:  # an error, a dead worker, Ctrl-C: the ranks are out of step now
            self._fail(e)
            raise
        self.steps += 1
        self.tokens += len(b.input_ids)
        self.forward_seconds += time.perf_counter() - start
        args = (self.cfg.num_layers, self.cfg.hidden_size, len(b.input_ids), hidden.element_size())
        mine = seams.plugged("allreduce_bytes_per_step")
        self.formula_bytes += allreduce_bytes_per_step(*args) if mine is None else _plugged_bytes(mine, args)
        return ModelOutput(logits, b.rows, b.offsets, b.input_ids, b.token_starts, b.sampling_table)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt, [len(token_ids), V] (teacher forcing), as
        ``model_runner.prompt_logits`` gives them for one process. The prompt is fed as one
        known token and the rest as drafts (every draft gets logits, as in verification).
        It writes the cache from block 0: call it on an engine with no requests in it."""
        from ..request import Request
        from ..sampling_params import SamplingParams
        from ..scheduler.output import ScheduledRequest

        blocks = -(-len(token_ids) // self.block_size)
        if blocks > self.kv_caches[0][0].shape[0]:
            raise ValueError(f"a prompt of {len(token_ids)} tokens needs {blocks} blocks; the cache has "
                             f"{self.kv_caches[0][0].shape[0]}")
        req = Request("prompt_logits", [int(token_ids[0])], SamplingParams())
        req.block_ids = list(range(blocks))
        row = ScheduledRequest(req, 1, spec_token_ids=[int(t) for t in token_ids[1:]])
        return self.execute(SchedulerOutput([row])).logits

    def time_all_reduce(self, numel: int, calls: int = 200) -> float:
        """Seconds per all-reduce of ``numel`` float32 numbers among the ranks with nothing else
        running: the collective's own cost (a step's all-reduce time adds the waits for the
        slower rank). Counted apart from the steps' counts."""
        from .worker import time_all_reduce

        if self.error is not None:
            raise RuntimeError(f"this tensor-parallel engine has stopped ({self.error}); build a new LLM")
        saved = (self.comm.all_reduce_calls, self.comm.all_reduce_bytes, self.comm.all_reduce_seconds,
                 self.comm.broadcast_seconds)
        try:
            self.comm.broadcast_object(("all_reduce", numel, calls))
            return time_all_reduce(self.comm, numel, calls)
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            (self.comm.all_reduce_calls, self.comm.all_reduce_bytes, self.comm.all_reduce_seconds,
             self.comm.broadcast_seconds) = saved

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        raise ValueError("CUDA graphs do not span processes: tensor_parallel_size > 1 runs every step eagerly")

    # -- what it measured -------------------------------------------------------------------
    def reset_counts(self) -> None:
        self.comm.reset_counts()
        self.steps, self.tokens = 0, 0
        self.forward_seconds = 0.0
        self.formula_bytes = 0

    def counts(self) -> dict[str, Any]:
        """Rank 0's totals since ``reset_counts``: steps, tokens, the seconds of its forwards
        split into compute and communication (all-reduce waits, the step's broadcast), and
        the bytes it all-reduced next to what the formula says they should be."""
        c = self.comm
        comm_s = c.all_reduce_seconds + c.broadcast_seconds
        return {"world_size": self.world_size, "threads_per_rank": self.threads, "steps": self.steps,
                "tokens": self.tokens, "forward_s": self.forward_seconds, "all_reduce_s": c.all_reduce_seconds,
                "broadcast_s": c.broadcast_seconds, "compute_s": self.forward_seconds - comm_s,
                "all_reduce_calls": c.all_reduce_calls, "all_reduce_bytes": c.all_reduce_bytes,
                "formula_bytes": self.formula_bytes}

    # -- shutting down ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (a no-op once stopped)."""
        if self.error is None:
            self.error = "closed"
        self._finalizer()
        self.store = None
        torch.set_num_threads(self._threads_before)

    def _fail(self, e: BaseException) -> None:
        dead = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()]
        self.error = (f"worker {', '.join(dead)} died" if dead else f"a step failed on rank 0: {type(e).__name__}")
        _stop_workers(self.procs, None)  # no stop message: the ranks may be inside different collectives
        self._finalizer.detach()
        torch.set_num_threads(self._threads_before)
        # a broken seam contract is the error to show, whichever rank stopped on it first
        if dead and not isinstance(e, (KeyboardInterrupt, seams.SeamContractError)):
            raise RuntimeError(f"tensor-parallel {self.error} in the middle of a step; the other workers were "
                               f"stopped. Build a new LLM to go on.") from e

    def _wait_ready(self, store) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank in range(1, self.world_size):
            p = self.procs[rank - 1] if self.procs else None  # None: torchrun started it
            while not store.check([f"ready/{rank}"]):
                if (p is not None and not p.is_alive()) or time.monotonic() > deadline:
                    why = f"exited with code {p.exitcode}" if p is not None and not p.is_alive() else "did not start in time"
                    _stop_workers(self.procs, None)
                    raise RuntimeError(f"tensor-parallel worker rank {rank} {why} while building its shard "
                                       f"(its error is printed above)")
                time.sleep(0.02)


def serve_torchrun_rank(rank: int, cfg: ModelConfig, weights: dict[str, torch.Tensor], world_size: int,
                        num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                        attention_backend: str, pack_weights: bool, threads: int | None = None) -> None:
    """Rank ``rank`` > 0 of a torchrun launch: serve rank 0's steps until it stops (then return).

    Every process of the launch runs the same script; its ``LLM(tensor_parallel_size=N)``
    comes here on ranks 1..N-1 (each cuts its own shard from weights it loaded itself) and
    the process exits when rank 0 closes its engine (``engine.build_engine``)."""
    from .worker import serve

    check_tensor_parallel(cfg, world_size)
    dev = str(torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if torch.device(device).type == "cuda"
              else device)
    serve(rank, world_size, torchrun_store(world_size), cfg, shard_weights(cfg, weights, world_size, rank), dev,
          dtype, attention_backend, pack_weights, num_blocks, block_size,
          threads or max(1, (os.cpu_count() or 1) // world_size), _plugged_for_workers())


def _plugged_bytes(mine, args: tuple[int, int, int, int]) -> int:
    """A learner's ``allreduce_bytes_per_step`` (the seam): its bytes, checked to be a count."""
    got = mine(*args)
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        raise seams.SeamContractError("allreduce_bytes_per_step", "the bytes are a non-negative int",
                                      f"{got!r} ({type(got).__name__}) for num_layers, hidden_size, num_tokens, "
                                      f"dtype_bytes = {args}")
    return got


def _worker_entry(*args) -> None:
    from .worker import worker_main

    worker_main(*args)


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _plugged_for_workers() -> dict:
    """The functions plugged into the seams a worker calls, checked to reach another process."""
    out = {}
    for name in WORKER_SEAMS:
        fn = seams.plugged(name)
        if fn is None:
            continue
        fn = getattr(fn, "__wrapped__", fn)  # the learner's own function, not seams.plug's guard around it
        try:
            pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"the function plugged into seam {name!r} cannot be sent to the worker processes "
                             f"({e}): define it in a module, e.g. exercises/ch10_beyond_one_device.py, "
                             f"not in a notebook cell") from None
        out[name] = fn
    return out


def _stop_workers(procs: list, comm: Communicator | None) -> None:
    """Ask the workers to stop (when the ranks are in step), then make sure they have."""
    if comm is not None and all(p.is_alive() for p in procs):
        try:
            comm.broadcast_object(None)
        except Exception:  # noqa: BLE001 -- a worker went away meanwhile: the joins below see to it
            pass
    for p in procs:
        p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if comm is not None:
        comm.group = None  # the process group goes now, not in the interpreter's teardown
