"""Scheduler wrappers."""

from .base_scheduler import xFuserSchedulerBaseWrapper, xFuserSchedulerWrapper

__all__ = ["xFuserSchedulerBaseWrapper", "xFuserSchedulerWrapper"]
