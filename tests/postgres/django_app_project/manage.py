"""manage.py of the Django project that installs celery_idempotent.contrib.django."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "appproj.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
