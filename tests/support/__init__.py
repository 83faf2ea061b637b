"""What the tests, the demo's tests and the benchmarks share: servers, workers, proxies, counters.

Imported as a package (``from tests.support.workers import CeleryWorker``): pytest puts the
repository's root on ``sys.path`` (``pythonpath = .`` in ``setup.cfg``), and ``python -m
benchmarks`` runs from there. The servers a user's own tests and the demo may start too (a
private Redis, a private PostgreSQL) and the process helpers are the library's, in
:mod:`celery_idempotent.servers`; this package holds what only this repository's tests need:

- :mod:`~tests.support.redis_bin`: which ``redis-server``/``redis-cli`` to run, and whether it
  has TLS; :mod:`~tests.support.ports`: free ports (a Cluster node's with its bus port);
  :mod:`~tests.support.redis_conf`: ``redis.conf`` lines and a raw PING;
- :mod:`~tests.support.redis_server`: one private server with every option a test needs
  (persistence, ACL, TLS, unix socket, cluster mode, restarts);
- :mod:`~tests.support.redis_cluster`, :mod:`~tests.support.sentinel`: a local Cluster, a
  Sentinel group;
- :mod:`~tests.support.proxy`: a TCP proxy that stalls and cuts connections;
- :mod:`~tests.support.keys`: a test's keys in a shared Redis, by prefix;
- :mod:`~tests.support.workers`: real ``celery worker`` processes, their trees read from
  ``/proc`` by :mod:`~tests.support.process_tree`;
- :mod:`~tests.support.counting`: round trips counted at the client (tests and benchmarks);
- :mod:`~tests.support.waiting`: ``wait_for`` what other processes do;
- :mod:`~tests.support.cleanup`: what is still open at exit is closed;
- :mod:`~tests.support.check_apps`: an app with one idempotent task, for the checks' tests;
- :mod:`~tests.support.sql_contract`: the SQL backends' shared contract.
"""
