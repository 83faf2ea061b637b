"""An example shop on Celery with celery-idempotent: orders, payments, receipts and shipments.

What to read (and copy), in this order:

- :mod:`example_project.settings`: the Celery settings duplicate safety needs, each with its why.
- :mod:`example_project.tasks`: four tasks, four ways to key them (explicit header, format
  string, task id, arguments).
- :mod:`example_project.celery`: the app, configured from the settings.
- :mod:`example_project.shop`: the simulated payment gateway, mail server and warehouse, which
  record every real side effect in Redis; :mod:`example_project.metrics`: counters the workers
  keep through the library's signals.

The load runner is apart, in :mod:`example_project.demo`: ``python -m example_project`` starts
Redis and real workers, sends bursts of duplicates (``--chaos`` kills workers mid-task) and
reports that everything ran exactly once; ``--backend postgres`` runs
:mod:`example_project.pgshop` on both backends and counts payment rows.
"""
