"""Schedulers, one file per policy."""
from .base import Scheduler, SchedulerOutput
from .continuous import ContinuousScheduler

__all__ = ["Scheduler", "SchedulerOutput", "ContinuousScheduler"]
