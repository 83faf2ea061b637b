# Load the Celery app when Django starts, so that @shared_task uses it.
from proj.celery import app as celery_app

__all__ = ["celery_app"]
