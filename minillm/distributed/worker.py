"""A tensor-parallel worker: ranks 1..N-1, each a process of its own.

A worker builds its shard of the model and of the KV cache, says it is ready, joins the
process group, then loops: receive the step (``model_runner.BatchPlan``, broadcast by rank
0), run its shard's forward (which all-reduces twice a layer with the other ranks), repeat
until rank 0 broadcasts None. Only rank 0 computes logits and samples. (One other message:
``("all_reduce", numel, calls)`` times the collective alone, ``TensorParallelRunner.time_all_reduce``.)

It never outlives its engine: it ignores Ctrl-C (the terminal sends SIGINT to the whole
process group, and rank 0 decides what happens), and a watchdog thread exits the process
when its parent is gone, whatever the way the parent died.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import torch

STOP = None  # what rank 0 broadcasts to end the loop


def time_all_reduce(comm, numel: int, calls: int) -> float:
    """Seconds per all-reduce of ``numel`` float32 numbers, ``calls`` in a row with no work
    between them: the collective's own cost, without waiting for a slower rank's compute.
    Every rank runs it at once (rank 0 asks the others with an ``("all_reduce", numel, calls)``
    message)."""
    t = torch.ones(numel)
    comm.all_reduce(t)  # the first call of a size sets up buffers
    start = time.perf_counter()
    for _ in range(calls):
        comm.all_reduce(t)
    return (time.perf_counter() - start) / calls


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # the engine's process is gone: nobody will ever send a step
        time.sleep(0.5)


def worker_main(rank: int, world_size: int, port: int, cfg, shard: dict, device: str, dtype: torch.dtype,
                attention_backend: str, pack_weights: bool, num_blocks: int, block_size: int, threads: int,
                plugged: dict, parent_pid: int) -> None:
    """A worker started by rank 0 (``spawn``): it watches its parent and ignores Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from .group import make_store

    serve(rank, world_size, make_store(rank, world_size, port), cfg, shard, device, dtype, attention_backend,
          pack_weights, num_blocks, block_size, threads, plugged)


def serve(rank: int, world_size: int, store, cfg, shard: dict, device: str, dtype: torch.dtype,
          attention_backend: str, pack_weights: bool, num_blocks: int, block_size: int, threads: int,
          plugged: dict) -> None:
    """Build this rank's shard and KV cache, join the group, run rank 0's steps until it stops."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(torch.device(device))
    from .. import seams
    from ..model_runner import allocate_kv_cache, batch_from_plan
    from .group import Communicator
    from .parallel_model import build_parallel_model

    comm = Communicator(rank, world_size, torch.device(device))
    model = build_parallel_model(cfg, shard, comm, torch.device(device), dtype, attention_backend, pack_weights)
    del shard
    kv_caches = allocate_kv_cache(model.cfg, num_blocks, block_size, torch.device(device), dtype)
    store.set(f"ready/{rank}", "1")
    comm.join(store)  # returns once every rank has joined
    with seams.plug(**plugged), torch.inference_mode():
        while True:
            plan = comm.broadcast_object()
            if plan is STOP:
                break
            if isinstance(plan, tuple) and plan[0] == "all_reduce":
                time_all_reduce(comm, plan[1], plan[2])
                continue
            b = batch_from_plan(plan, torch.device(device))
            model(b.input_ids, b.positions, b.meta, kv_caches)
