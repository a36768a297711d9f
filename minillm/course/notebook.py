"""What the chapters share: the model loaded once, engines built on it, runs and timings.

Each chapter used to define these few helpers itself; they live here so that a notebook
shows only what is new in it.

    lab = Lab()                                   # weights + tokenizer of the real model
    eng = lab.engine("paged", max_num_seqs=4)     # an LLMEngine on those weights
    res = lab.run("continuous", workload)         # a RunResult (lab/summary.py)
    t = time_fn(lambda: ..., reps=5)              # seconds, device work included
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from minillm import loader, placement
from minillm.config import EngineConfig
from minillm.engine import LLMEngine, build_engine
from minillm.bench.compare import run_minillm
from minillm.bench.summary import RunResult
from minillm.bench.workload import Workload


class Lab:
    """The real SmolLM2's weights and tokenizer, loaded once for a whole chapter."""

    def __init__(self) -> None:
        self.gpu = torch.cuda.is_available()
        self.weights = loader.load_weights()
        self.tokenizer = loader.load_tokenizer()

    def engine(self, engine: str = "paged", **options: Any) -> LLMEngine:
        """An engine on the loaded weights; ``options`` are ``EngineConfig`` fields."""
        return build_engine(EngineConfig(engine=engine, **options), weights=self.weights, tokenizer=self.tokenizer)

    def run(self, engine: str, workload: Workload, progress: bool = True, **options: Any) -> RunResult:
        """``engine`` on ``workload``, arrivals replayed in real time, as the benchmark runs it.

        ``max_model_len`` defaults to the workload's (its longest request, rounded up).
        """
        options.setdefault("max_model_len", workload.default_max_model_len())
        return run_minillm(engine, workload, self.weights, self.tokenizer, progress=progress, **options)


def time_fn(fn: Callable[[], Any], reps: int, warmup: int = 2, stat: Callable = min,
            device: torch.device | str | None = None) -> float:
    """Seconds of ``fn()``: ``stat`` (min: noise only adds time) of ``reps`` runs after ``warmup``.

    Waits for the device before and after each run, so queued GPU work is timed too.
    """
    dev = torch.device(device) if device is not None else placement.resolve().device
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        placement.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        placement.synchronize(dev)
        samples.append(time.perf_counter() - t0)
    return stat(samples)


__all__ = ["Lab", "time_fn"]
