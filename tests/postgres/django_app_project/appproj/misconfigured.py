"""The recipe's settings with the slips a first day brings (the worker start log must show
each one, one line per problem)."""

from appproj.settings import *  # noqa: F403

CELERY_IDEMPOTENT_URL = "django://default"  # a typo: IDEMPOTENT for IDEMPOTENCY
CELERY_IDEMPOTENCY_TLL = 7 * 24 * 3600  # a typo: TLL for TTL
CELERY_IDEMPOTENCY_URL = "django://replica"  # no such alias in DATABASES
CELERY_TASK_REJECT_ON_WORKER_LOST = False  # acks_late alone loses a killed body's call
