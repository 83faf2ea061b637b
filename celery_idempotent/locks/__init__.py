"""Lock providers: in memory, and Redis (imported on first use)."""

from celery_idempotent.locks.memory import MemoryLockProvider

__all__ = ["MemoryLockProvider"]
