"""Alembic migrations of the server's database (``alembic upgrade head`` runs at start-up)."""
