import os

# In-process tests need no broker: eager calls never publish, and the in-process worker of
# tests/test_worker.py uses Celery's in-memory transport. Set before shop is imported.
os.environ.setdefault("SHOP_BROKER_URL", "memory://")
os.environ.setdefault("SHOP_RESULT_BACKEND", "cache+memory://")
