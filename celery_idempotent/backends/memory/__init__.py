"""In-process lock provider and store (tests, one process)."""
