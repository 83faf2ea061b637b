"""The backends: one package each (memory, Redis, PostgreSQL)."""
