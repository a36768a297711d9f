"""Schedulers, one file per policy."""
from .base import Scheduler, SchedulerOutput
from .continuous import ContinuousScheduler
from .paged import PagedScheduler
from .static import StaticScheduler, StaticSchedulerOutput

__all__ = [
    "Scheduler", "SchedulerOutput", "ContinuousScheduler", "PagedScheduler", "StaticScheduler",
    "StaticSchedulerOutput",
]
