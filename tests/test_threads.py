"""The CPU thread governor: the full team on an idle machine, fewer threads next to busy programs."""
from __future__ import annotations

import pytest
import torch

from minillm import threads
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


class FakeClock:
    """Stands in for /proc/stat, this process's CPU time and the monotonic clock."""

    def __init__(self, monkeypatch):
        self.t, self.busy, self.own = 0.0, 0, 0
        monkeypatch.setattr(threads, "_busy_ticks", lambda: self.busy)
        monkeypatch.setattr(threads, "_own_ticks", lambda: self.own)
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.t)

    def advance(self, seconds: float, others_cores: float, own_cores: float) -> None:
        tick = threads._TICK
        self.t += seconds
        self.own += round(own_cores * seconds * tick)
        self.busy += round((others_cores + own_cores) * seconds * tick)


def test_threads_for_leaves_the_cores_others_use(monkeypatch):
    gov = threads.ThreadGovernor(max_threads=2)
    gov.cores = 2
    assert gov.threads_for(0.0) == 2
    assert gov.threads_for(0.4) == 2
    assert gov.threads_for(1.0) == 1
    assert gov.threads_for(5.0) == 1  # never fewer than one
    gov.cores, gov.max_threads = 16, 8
    assert gov.threads_for(1.0) == 8  # never more than the ceiling


def test_governor_drops_to_one_thread_next_to_a_busy_program_and_comes_back(monkeypatch):
    clock = FakeClock(monkeypatch)
    torch.set_num_threads(2)
    gov = threads.ThreadGovernor(max_threads=2, interval=0.5, smoothing=0.0)
    gov.cores = 2
    clock.advance(0.1, others_cores=1.0, own_cores=2.0)
    assert gov.tick() == 2  # inside the interval: no look
    clock.advance(0.5, others_cores=1.0, own_cores=1.0)
    assert gov.tick() == 1 and torch.get_num_threads() == 1
    clock.advance(0.6, others_cores=0.0, own_cores=1.0)
    assert gov.tick() == 2 and torch.get_num_threads() == 2
    assert gov.changes == 2


def test_smoothing_ignores_one_short_burst(monkeypatch):
    clock = FakeClock(monkeypatch)
    torch.set_num_threads(2)
    gov = threads.ThreadGovernor(max_threads=2, interval=0.5, smoothing=0.5)
    gov.cores = 2
    clock.advance(0.6, others_cores=0.8, own_cores=2.0)  # smoothed: 0.4 -> keep 2
    assert gov.tick() == 2


def test_user_thread_count_is_the_ceiling(monkeypatch):
    torch.set_num_threads(1)
    assert threads.ThreadGovernor().max_threads == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, "many", True])
def test_cpu_threads_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=bad)


def test_engine_fixed_count_and_auto():
    eng = build_engine(EngineConfig(engine="continuous", cpu_threads=1), model_config=TINY, tokenizer=None)
    assert eng.threads is None and torch.get_num_threads() == 1
    eng = build_engine(EngineConfig(engine="continuous"), model_config=TINY, tokenizer=None)
    assert isinstance(eng.threads, threads.ThreadGovernor)  # "auto" on the CPU (Linux: /proc/stat)
    eng = build_engine(EngineConfig(engine="continuous", cpu_threads=None), model_config=TINY, tokenizer=None)
    assert eng.threads is None


@pytest.mark.parametrize("command", ["bench", "profile_step"])
def test_a_command_run_in_process_leaves_torch_threads_as_they_were(command, monkeypatch):
    """``compare.main([... "--threads", "1"])`` in a notebook or a test sets torch's count for
    the whole process while it runs; afterwards the process is on its own count again."""
    from minillm.bench import compare, profile_step

    module, name = (compare, "run_benchmark") if command == "bench" else (profile_step, "profile_decode")
    real, seen = getattr(module, name), []

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    torch.set_num_threads(2)
    if command == "bench":
        argv = ["--dummy-weights", "--workload", "uniform", "--num-requests", "2", "--workload-param", "prompt_len=8",
                "--workload-param", "output_len=2", "--max-num-seqs", "2", "--no-progress"]
    else:
        argv = ["--dummy-weights", "--batch", "1", "--steps", "2", "--context", "8"]
    assert module.main(argv + ["--threads", "1"]) == 0
    assert seen and set(seen) == {1}  # the flag held while it ran
    assert torch.get_num_threads() == 2
