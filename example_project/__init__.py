"""An example shop on Celery with celery-idempotent: orders, payments, receipts and shipments.

- :mod:`example_project.settings`: the Celery settings duplicate safety needs, each with its why.
- :mod:`example_project.tasks`: four tasks, four ways to key them (explicit header, format
  string, task id, arguments).
- :mod:`example_project.shop`: the simulated payment gateway, mail server and warehouse, which
  record every real side effect in Redis.
- ``python -m example_project``: starts Redis and real workers, sends bursts of duplicates
  (``--chaos`` kills workers mid-task) and reports that everything ran exactly once.
"""
