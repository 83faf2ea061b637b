"""Celery settings of the example shop, with the reason for every choice that duplicates depend on.

``example_project.celery`` loads this module with ``app.config_from_object``. Values that differ
between machines come from the environment (``EXAMPLE_*``); ``python -m example_project`` sets
them for the workers it starts. In a Django project the same names go into ``settings.py`` with
the ``CELERY_`` prefix (``CELERY_TASK_ACKS_LATE = True``, ``CELERY_IDEMPOTENCY_URL = ...``).

Lower-case names are Celery settings (and the library's ``idempotency_*`` ones); upper-case
names are the shop's own constants and knobs, which Celery ignores.
"""

from __future__ import annotations

import os


def _env(name: str, default: str) -> str:
    return os.environ.get(f"EXAMPLE_{name}", default)


#: Namespace of everything this app keeps in Redis and of its queue, so that two deployments
#: (or two demo runs) that share a Redis never see each other's keys or steal each other's tasks.
NAMESPACE = _env("NAMESPACE", "shop")

# --- where messages, results and idempotency records live ------------------------------------

broker_url = _env("BROKER_URL", "redis://127.0.0.1:6379/0")

# Callers read results here, replays included: a duplicate's AsyncResult.get() returns the stored
# result, and a refused delivery re-raises IdempotencyMismatchError (an except-able class).
result_backend = _env("RESULT_BACKEND", "redis://127.0.0.1:6379/1")
result_expires = 24 * 3600

# Locks and stored results of IdempotentTask. A database of its own (not the broker's): purging
# the queue or flushing the broker's database must never forget which payments already ran.
# When unset, the library falls back to broker_url if that is a Redis URL; with RabbitMQ as the
# broker it must be set.
idempotency_url = _env("IDEMPOTENCY_URL", "redis://127.0.0.1:6379/2")

# --- delivery: turn "lost" into "delivered again", which IdempotentTask makes harmless ---------

# Acknowledge a message after the task finished, not when a worker received it. A worker that
# dies mid-task (OOM killer, SIGKILL, a deploy, a lost host) then leaves the message unacked and
# the broker delivers it again. Without this the task is lost; with it the task may run twice,
# which is the duplicate IdempotentTask exists to absorb.
task_acks_late = True

# When a prefork child dies mid-task, requeue its message at once instead of recording a failure
# (WorkerLostError). The redelivery finds the dead child's lease still held and is re-queued with
# back-off (idempotency_on_locked="retry") until that lease expires (idempotency_lock_ttl), then
# runs the body: the task is neither lost nor committed twice.
task_reject_on_worker_lost = True

# Reserve one message per pool process. With acks_late every prefetched message is unacked too:
# a large multiplier lets a worker that dies hold many messages until they are redelivered, and
# lets a long task delay the short ones queued behind it in the same process.
worker_prefetch_multiplier = 1

#: The longest countdown/ETA this app schedules: send_receipt_email retries an unreachable mail
#: server after up to this many seconds. The visibility timeout below must exceed it.
LONGEST_COUNTDOWN = 15 * 60
#: The longest a task body runs here (a slow payment gateway); also below the visibility timeout.
LONGEST_TASK = 5 * 60

# Redis (and SQS) brokers: a message not acknowledged within visibility_timeout is handed to
# another worker, even if the first one is alive and busy. It must exceed both the longest task
# and the longest countdown/ETA: a worker holds an ETA message unacked until it is due, so a
# countdown longer than the timeout makes the broker restore the message and run it again, once
# per timeout (the classic "my ETA task ran three times"). IdempotentTask turns those copies into
# replays, but each one still costs a delivery. The price of a long timeout: after a whole worker
# host dies, its unacked messages wait this long before they are redelivered.
# (RabbitMQ ignores it and redelivers when the consumer's connection closes.)
broker_transport_options = {"visibility_timeout": 2 * max(LONGEST_COUNTDOWN, LONGEST_TASK)}

# A worker started before the broker is up keeps trying instead of exiting (and Celery 5.3+
# warns unless this is set explicitly).
broker_connection_retry_on_startup = True

# --- serialization --------------------------------------------------------------------------

# IdempotentTask stores results with the result serializer and reads them back accepting only
# this list: JSON never runs code read from a shared Redis (pickle would).
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# --- idempotency -------------------------------------------------------------------------------

# How long a completed key is replayed. It must outlive every way a duplicate can arrive: a
# redelivery (visibility_timeout), a retry's countdown, a client retrying its request the next
# morning. 24 h, like Stripe's idempotency keys.
idempotency_ttl = 24 * 3600

# Seconds of a key's lease. It is renewed while the body runs, so it does not limit how long a
# task may take; it bounds how long a key stays blocked after its worker died (SIGKILL, power
# loss) before a redelivery may run the body again. Short enough to recover fast, long enough
# that a stalled process (GC pause, a swapped-out VM) does not lose its lease between renewals.
idempotency_lock_ttl = float(_env("LOCK_TTL", "10"))

# A duplicate that arrives while the first delivery still runs is re-queued with a growing
# countdown (at most 5 s, not counted against max_retries) and ends with the stored result,
# instead of failing ("raise") or being dropped ("ignore").
idempotency_on_locked = "retry"

# Keys derive from the arguments unless a task says otherwise (see tasks.py).
idempotency_key = "args"
idempotency_key_prefix = f"{NAMESPACE}:idempotency:"

# The kill switch: False runs every task plainly, without a guard (python -m example_project
# --without-idempotency shows what that costs).
idempotency_enabled = _env("IDEMPOTENCY_ENABLED", "1") == "1"

# --- queue and worker ---------------------------------------------------------------------------

task_default_queue = f"{NAMESPACE}.tasks"
# The demo stops its workers by signal and needs no remote control; in production leave it on
# (celery inspect, Flower). Off, the workers leave no pidbox bindings behind in a shared broker.
worker_enable_remote_control = _env("REMOTE_CONTROL", "1") == "1"

# --- the shop's own knobs (not Celery settings) -------------------------------------------------

#: Where the simulated outside world (payment gateway, mail server, warehouse) records what it
#: was asked to do, so that the demo can count real executions.
LEDGER_URL = _env("LEDGER_URL", idempotency_url)
#: Seconds a simulated gateway, mail server or warehouse call takes.
LATENCY = float(_env("LATENCY", "0.02"))
#: First retry countdown of send_receipt_email, doubled on each retry (capped at LONGEST_COUNTDOWN).
MAIL_RETRY_BASE = float(_env("MAIL_RETRY_BASE", "30"))
