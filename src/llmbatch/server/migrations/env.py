"""Alembic's entry point: migrate the connection the server hands over (``db.migrate``), or
the URL in ``sqlalchemy.url`` when run as ``alembic -x`` from a shell."""

from alembic import context
from sqlalchemy import engine_from_config, pool

config = context.config


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=None, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = engine_from_config(config.get_section(config.config_ini_section) or {}, prefix="sqlalchemy.",
                                poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=None, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


run()
