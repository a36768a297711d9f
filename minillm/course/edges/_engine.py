"""What the edge cases share: the real engine on a virtual clock, and what to compare of a run."""
from __future__ import annotations

from typing import Any, Sequence


def schedule(steps) -> list[tuple]:
    """Per step: who ran and how many tokens each fed, and the KV bytes held after it."""
    return [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in steps]


def simulated(prompt_lens: Sequence[int], output_lens: Sequence[int], engine: str, max_num_seqs: int,
              arrival_times: Sequence[float] | None = None, **options: Any) -> dict[str, Any]:
    """The engine ``engine`` on hand-made lengths, no model (``bench.cost_model.simulate``):
    its schedule, the tokens (the simulator samples token 0) and the preemptions."""
    from minillm.bench.cost_model import simulate
    from minillm.bench.workload import workload_from_lengths

    run = simulate(workload_from_lengths(prompt_lens, output_lens, arrival_times=arrival_times), engine,
                   max_num_seqs, **options)
    return {"schedule": schedule(run.steps), "preemptions": [m.num_preemptions for m in run.metrics],
            "tokens": run.output_token_ids}
