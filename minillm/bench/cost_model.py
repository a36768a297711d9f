"""A step-time model fitted on measured steps, and a simulator that uses it.

The simulator IS the engine: the same ``LLMEngine`` step loop and scheduler, with a
``CostModelRunner`` in place of the model runner and a virtual clock in place of wall
time. Each step advances the clock by the time the cost model predicts for it. No
model, no weights: a whole benchmark replays in well under a second, so widgets can
redraw while a slider moves.

The cost of one step, in seconds, is modelled as a sum of what the forward does:

    t = overhead                       Python, kernel launches, building the batch
      + per_token   * new tokens       every weight matrix multiplies every new token
      + per_context * sum(context)     attention reads each row's K/V
      + per_padded_context * decode rows * longest context
                                       a batched decode that pads keys to the longest row
      + per_sample  * sampled rows     LM head (576 x 49152) and sampling per sampled row

Coefficients come from a least-squares fit on ``StepRecord``s of real runs (kept
non-negative), so the model describes this machine. It is a model: check a point
against the real engine before trusting a conclusion (``viz.explorer`` has a button).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from minillm.config import EngineConfig, ModelConfig
from minillm.model_runner import ModelOutput
from minillm.metrics import StepRecord
from minillm.bench.summary import RunResult
from minillm.bench.workload import Workload

FEATURES = ("overhead", "per_token", "per_context", "per_padded_context", "per_sample")


def step_features(num_new_tokens: Sequence[int], context_lens: Sequence[int], num_sampled: int) -> list[float]:
    """The five regressors of one step (context_lens include this step's tokens)."""
    decode_rows = sum(1 for n in num_new_tokens if n == 1)
    longest = max(context_lens, default=0)
    return [1.0, float(sum(num_new_tokens)), float(sum(context_lens)), float(decode_rows * longest),
            float(num_sampled)]


def record_features(s: StepRecord) -> list[float]:
    decode_rows = sum(1 for n in s.num_new_tokens if n == 1)
    return [1.0, float(s.num_tokens), float(s.context_tokens), float(decode_rows * s.max_context),
            float(s.num_sampled)]


@dataclass(frozen=True)
class CostModel:
    overhead: float = 0.030
    per_token: float = 0.0006
    per_context: float = 0.0
    per_padded_context: float = 2e-5
    per_sample: float = 0.004
    source: str = "untuned defaults (fit on your own steps with CostModel.fit)"

    @property
    def coefficients(self) -> list[float]:
        return [getattr(self, f) for f in FEATURES]

    def predict(self, features: Sequence[float]) -> float:
        return sum(c * x for c, x in zip(self.coefficients, features))

    def step_time(self, num_new_tokens: Sequence[int], context_lens: Sequence[int], num_sampled: int) -> float:
        return self.predict(step_features(num_new_tokens, context_lens, num_sampled))

    @classmethod
    def reference(cls) -> "CostModel":
        """The shipped reference: a fit on chapter 02's measured steps on a 2-core x86 CPU
        (SmolLM2-135M, float32, the cpu backend, 1096 steps). It draws a chapter's charts
        before anything is measured (an instructor's first minute); the chapters then fit
        their own on this machine's steps."""
        return cls(overhead=0.0765, per_token=0.00194, per_context=0.0, per_padded_context=0.0, per_sample=0.0,
                   source="reference: chapter 02's steps on a 2-core x86 CPU, float32 (1096 steps)")

    @classmethod
    def fit(cls, steps: Sequence[StepRecord], source: str = "fit on measured steps") -> "CostModel":
        """Non-negative least squares on measured steps (drops negative terms and refits)."""
        import numpy as np

        if len(steps) < 2:
            raise ValueError(f"need at least 2 measured steps to fit a cost model, got {len(steps)}")
        X = np.array([record_features(s) for s in steps])
        y = np.array([s.duration for s in steps])
        # Scale columns so the solver treats them alike, then fit; drop any term that
        # comes out negative (a negative cost has no physical meaning) and refit.
        scale = np.maximum(np.abs(X).max(axis=0), 1e-12)
        active = [j for j in range(X.shape[1]) if np.any(X[:, j])]
        coef = np.zeros(X.shape[1])
        while active:
            sol, *_ = np.linalg.lstsq(X[:, active] / scale[active], y, rcond=None)
            if (sol >= 0).all():
                coef[active] = sol / scale[active]
                break
            active = [j for j, c in zip(active, sol) if c >= 0]
        return cls(*[float(c) for c in coef], source=f"{source} ({len(steps)} steps)")

    def error(self, steps: Sequence[StepRecord]) -> float:
        """Relative error of the total predicted time over ``steps``."""
        real = sum(s.duration for s in steps)
        pred = sum(self.predict(record_features(s)) for s in steps)
        return (pred - real) / real if real else 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class CostModelRunner:
    """Stands in for ``ModelRunner``: no forward, the clock advances by the predicted step time.

    Its logits are one column of zeros, so every sampled token is 0: what a simulated
    request generates does not matter, only how many tokens (workloads ignore EOS).
    """

    def __init__(self, cost: CostModel, clock: Any):
        self.cost = cost
        self.clock = clock

    def execute(self, out: Any) -> ModelOutput:
        new = [row.num_new_tokens for row in out.rows]
        ctx = [row.request.num_computed_tokens + row.num_new_tokens for row in out.rows]
        sampling = [i for i, row in enumerate(out.rows) if row.samples]
        self.clock.advance(self.cost.step_time(new, ctx, len(sampling)))
        return ModelOutput(torch.zeros(len(sampling), 1), sampling, list(range(len(sampling))))


def simulate(workload: Workload, engine: str = "continuous", max_num_seqs: int = 8,
             max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
             cost: CostModel | None = None, model_config: ModelConfig | None = None,
             dtype: str = "float32", **options: Any) -> RunResult:
    """Run ``workload`` through the engine ``engine`` on a virtual clock, stepping by ``cost``.

    ``options``: any other ``EngineConfig`` option (``block_size``, ``num_blocks``,
    ``enable_chunked_prefill``, ...). KV bytes are counted in ``dtype``.
    """
    from minillm.clock import VirtualClock
    from minillm.engine import LLMEngine
    from minillm.resolve import resolve
    from minillm.scheduler import build_scheduler

    cost = cost or CostModel()
    mcfg = model_config or ModelConfig()
    cfg = EngineConfig(engine=engine, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       max_model_len=max_model_len or workload.default_max_model_len(), dummy_weights=True,
                       device="cpu", dtype=dtype, **options)
    rc = resolve(cfg, mcfg)
    clock = VirtualClock()
    eng = LLMEngine(cfg, rc, mcfg, None, build_scheduler(cfg, rc, mcfg.eos_token_id), CostModelRunner(cost, clock),
                    clock=clock)
    requests = [eng.make_request(list(wr.prompt_token_ids), wr.sampling_params(), arrival_time=wr.arrival_time,
                                 request_id=wr.request_id) for wr in workload]
    outs = eng.run(requests)
    return RunResult(
        engine=f"{engine} (simulated)", metrics=[r.metrics for r in requests],
        output_token_ids=[o.token_ids for o in outs], steps=eng.step_records, start=0.0,
        end=max(r.metrics.finish_time for r in requests), num_slots=max_num_seqs,
        kv_cache_bytes=rc.kv_cache_bytes, num_prompt_tokens=[r.num_prompt_tokens for r in requests])


def calibration_steps(engine, batch_sizes: Sequence[int] = (1, 4, 8), contexts: Sequence[int] = (16, 256),
                      decode_steps: int = 3) -> list[StepRecord]:
    """Measure a small grid of steps on a real ``LLMEngine``: prefills and decodes at
    several batch sizes and context lengths. Returns their StepRecords (for ``fit``)."""
    from minillm.sampling_params import SamplingParams

    records: list[StepRecord] = []
    B_max = engine.scheduler.max_num_seqs
    for ctx in contexts:
        for B in batch_sizes:
            B = min(B, B_max)
            params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
            reqs = [engine.make_request([100 + (i * 7 + j) % 1000 for j in range(ctx)], params) for i in range(B)]
            first = len(engine.step_records)
            engine.run(reqs)
            records.extend(engine.step_records[first:])
    return records


__all__ = ["CostModel", "CostModelRunner", "simulate", "calibration_steps", "step_features", "record_features", "FEATURES"]
