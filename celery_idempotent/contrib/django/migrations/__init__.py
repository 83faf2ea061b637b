"""The app's migrations: ``0001_initial`` creates the idempotency table."""
