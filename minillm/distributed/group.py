"""The ranks' process group, and a count of what goes through it.

A ``Communicator`` wraps one torch.distributed process group of its own (gloo on the
CPU, NCCL on CUDA), built on a ``TCPStore`` that rank 0 hosts. It is not the process's
default group: two tensor-parallel engines can live in one process (a notebook that
compares them), and a program that already runs under ``torchrun`` keeps its own.

Every collective is counted: calls, bytes and the seconds spent inside it. The seconds
are what a rank waits, so they include the slower rank's lag (load imbalance), not only
the bytes on the wire.
"""
from __future__ import annotations

import datetime
import os
import pickle
import time

import torch
import torch.distributed as dist

# Seconds a collective may wait for the other ranks before it fails. A long prefill on a
# small CPU takes seconds; a dead rank is noticed sooner (its sockets close).
TIMEOUT_S = 300.0


def make_store(rank: int, world_size: int, port: int = 0, host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0 hosts the rendezvous store (``port=0``: any free port, read back from
    ``store.port``); the other ranks connect to it."""
    return dist.TCPStore(host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                         wait_for_workers=False)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when ``torchrun`` started this process, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def torchrun_store(world_size: int) -> dist.Store:
    """The store torchrun's agent hosts at MASTER_ADDR:MASTER_PORT, every rank a client of it,
    under a prefix of this engine's own."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return dist.PrefixStore("minillm-tp", store)


class Communicator:
    """All-reduce and broadcast over one process group, counted."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.group = None  # join() connects it; a model can be built around the communicator before
        self.reset_counts()

    def join(self, store: dist.TCPStore) -> None:
        """Connect to the other ranks through ``store``; returns once every rank has joined."""
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, self.rank, self.world_size)
        else:
            self.group = dist.ProcessGroupGloo(store, self.rank, self.world_size, timeout)

    def reset_counts(self) -> None:
        self.all_reduce_calls = 0
        self.all_reduce_bytes = 0
        self.all_reduce_seconds = 0.0
        self.broadcast_seconds = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place; returns ``t``."""
        start = time.perf_counter()
        self.group.allreduce([t]).wait()
        self.all_reduce_seconds += time.perf_counter() - start
        self.all_reduce_calls += 1
        self.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank: its pickle's length, then its bytes (two broadcasts)."""
        start = time.perf_counter()
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        on = self.device if self.device.type == "cuda" else None  # NCCL moves device tensors only
        self._broadcast(size, on)
        if self.rank != 0:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(payload, on)
        self.broadcast_seconds += time.perf_counter() - start
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor, device) -> None:
        if device is None:
            self.group.broadcast(t, 0).wait()
            return
        d = t.to(device)
        self.group.broadcast(d, 0).wait()
        t.copy_(d.cpu())
