"""The core: the guard, its protocols, lease keeping, back-off, codec and errors.

Imports neither Celery nor a backend.
"""
