"""Benchmarks of celery-idempotent against the libraries users pick today.

Run ``python -m benchmarks --help`` from the repository root; see ``benchmarks/README.md``.
"""
