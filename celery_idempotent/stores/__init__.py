"""Idempotency stores: in memory, and Redis (imported on first use)."""

from celery_idempotent.stores.memory import MemoryIdempotencyStore

__all__ = ["MemoryIdempotencyStore"]
