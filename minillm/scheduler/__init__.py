"""Schedulers, one file per policy, and the registry that builds one for an engine name."""
from __future__ import annotations

from ..config import ENGINES, EngineConfig, ResolvedConfig
from .base import Scheduler
from .continuous import ContinuousScheduler
from .output import ScheduledRequest, SchedulerOutput
from .paged import PagedScheduler
from .static import StaticScheduler

# Engine name -> its scheduler. "simple" is the continuous scheduler with one slot.
SCHEDULERS: dict[str, type[Scheduler]] = {"simple": ContinuousScheduler, "static": StaticScheduler,
                                          "continuous": ContinuousScheduler, "paged": PagedScheduler}
assert tuple(SCHEDULERS) == ENGINES, "config.ENGINES names the engines this registry builds"


def build_scheduler(config: EngineConfig, resolved: ResolvedConfig, eos_token_id: int) -> Scheduler:
    """The scheduler of ``config.engine``, sized by the resolved configuration."""
    rc = resolved
    if config.engine == "paged":
        return PagedScheduler(rc.max_num_seqs, rc.max_num_batched_tokens, rc.max_model_len, eos_token_id,
                              rc.num_blocks, rc.block_size, watermark=config.watermark,
                              enable_chunked_prefill=config.enable_chunked_prefill,
                              speculative=config.speculative,
                              enable_prefix_caching=config.enable_prefix_caching,
                              scheduling_policy=config.scheduling_policy, queue_timeouts=config.queue_timeouts,
                              kv_offload=config.kv_offload)
    return SCHEDULERS[config.engine](rc.max_num_seqs, rc.max_num_batched_tokens, rc.max_model_len, eos_token_id)


__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest", "ContinuousScheduler", "PagedScheduler",
           "StaticScheduler", "SCHEDULERS", "build_scheduler"]
