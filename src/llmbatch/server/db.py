"""The server's metadata: files and batches, in a real database (SQLite by default, any
SQLAlchemy URL otherwise), its schema made and upgraded by Alembic migrations at start-up.

Status changes are conditional updates (``transition``): a cancel arriving while the runner
finishes a batch cannot be lost or undone, whichever thread writes first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait for the runner's writes
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def migrate(engine: sa.Engine) -> str:
    """Bring the database to the newest schema (``alembic upgrade head``); returns its revision."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() or ""


class Database:
    """Files and batches (rows as dicts)."""

    def __init__(self, url: str):
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 10}
        self.engine = sa.create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.revision = migrate(self.engine)
        self.meta = sa.MetaData()
        self.files = sa.Table("files", self.meta, autoload_with=self.engine)
        self.batches = sa.Table("batches", self.meta, autoload_with=self.engine)

    # -- generic -----------------------------------------------------------------------------

    def insert(self, table: sa.Table, row: dict[str, Any]) -> None:
        with self.engine.begin() as conn:
            conn.execute(table.insert().values(**row))

    def get(self, table: sa.Table, id_: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            found = conn.execute(sa.select(table).where(table.c.id == id_)).mappings().first()
        return dict(found) if found else None

    def page(self, table: sa.Table, after: str | None, limit: int, newest_first: bool = True,
             where: Any = None) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` rows after the row ``after`` (by creation order), and whether more follow."""
        query = sa.select(table)
        if where is not None:
            query = query.where(where)
        with self.engine.connect() as conn:
            if after:
                seq = conn.execute(sa.select(table.c.seq).where(table.c.id == after)).scalar()
                if seq is not None:
                    query = query.where(table.c.seq < seq if newest_first else table.c.seq > seq)
            order = table.c.seq.desc() if newest_first else table.c.seq.asc()
            rows = conn.execute(query.order_by(order).limit(limit + 1)).mappings().all()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    # -- batches -----------------------------------------------------------------------------

    def transition(self, batch_id: str, from_status: tuple[str, ...] | None, **fields: Any) -> bool:
        """Update a batch only while its status is one of ``from_status``; returns whether it did."""
        query = self.batches.update().where(self.batches.c.id == batch_id)
        if from_status is not None:
            query = query.where(self.batches.c.status.in_(from_status))
        with self.engine.begin() as conn:
            return conn.execute(query.values(**fields)).rowcount == 1

    def batches_in(self, statuses: tuple[str, ...]) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(self.batches).where(self.batches.c.status.in_(statuses))
                                .order_by(self.batches.c.seq)).mappings().all()
        return [dict(r) for r in rows]

    def file_in_use(self, file_id: str, unfinished: tuple[str, ...]) -> str | None:
        """The id of an unfinished batch that reads ``file_id``, if any."""
        b = self.batches
        with self.engine.connect() as conn:
            return conn.execute(sa.select(b.c.id).where(b.c.input_file_id == file_id, b.c.status.in_(unfinished))
                                .limit(1)).scalar()

    def delete_file(self, file_id: str) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(self.files.delete().where(self.files.c.id == file_id)).rowcount == 1

    def close(self) -> None:
        self.engine.dispose()
