"""Kept for imports of the private module of earlier versions (0.1.0 and tests): the library
imports the public modules these names come from, ``redis_client`` (clients, Sentinel, tokens),
``redis_errors`` (error translation) and the scripts of ``redis_scripts``,
``redis_publish_scripts`` and ``redis_admin_scripts``.
"""

from __future__ import annotations

from celery_idempotent.redis_admin_scripts import DROP_FENCE, FORGET, READ_KEY
from celery_idempotent.redis_client import (
    CLIENT_DEFAULTS,
    INSTALL_HINT,
    SentinelClientFactory,
    decodes_responses,
    default_owner_id,
    glob_escape,
    import_redis,
    make_client,
    ms,
    new_token,
    same_server,
    sentinel_factory_from_broker,
    why_not_same_server,
)
from celery_idempotent.redis_errors import TRANSIENT_REPLIES, is_transient_reply, translate_errors
from celery_idempotent.redis_publish_scripts import DROP_QUEUED, PUBLISH, PUBLISH_AND_PUSH
from celery_idempotent.redis_scripts import ACQUIRE, CLAIM, COMMIT, EXTEND, HOLDER, RELEASE

__all__ = [
    "ACQUIRE",
    "CLAIM",
    "CLIENT_DEFAULTS",
    "COMMIT",
    "DROP_FENCE",
    "DROP_QUEUED",
    "EXTEND",
    "FORGET",
    "HOLDER",
    "INSTALL_HINT",
    "PUBLISH",
    "PUBLISH_AND_PUSH",
    "READ_KEY",
    "RELEASE",
    "TRANSIENT_REPLIES",
    "SentinelClientFactory",
    "decodes_responses",
    "default_owner_id",
    "glob_escape",
    "import_redis",
    "is_transient_reply",
    "make_client",
    "ms",
    "new_token",
    "same_server",
    "sentinel_factory_from_broker",
    "translate_errors",
    "why_not_same_server",
]
