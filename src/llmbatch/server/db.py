"""The server's metadata: files and batches, in a real database (SQLite by default, any
SQLAlchemy URL otherwise), its schema made and upgraded by Alembic migrations at start-up.

Status changes are conditional updates (``transition``): a cancel arriving while the runner
finishes a batch cannot be lost or undone, whichever thread writes first. Every file and batch
has a ``tenant``; the routes read through ``get(..., tenant=)`` and ``page(..., tenant=)``, so
one tenant never sees another's rows.
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
        self.lease = sa.Table("server_lease", self.meta, autoload_with=self.engine)

    # -- generic -----------------------------------------------------------------------------

    def insert(self, table: sa.Table, row: dict[str, Any]) -> None:
        with self.engine.begin() as conn:
            conn.execute(table.insert().values(**row))

    def get(self, table: sa.Table, id_: str, tenant: str | None = None) -> dict[str, Any] | None:
        """The row ``id_``; with ``tenant``, only if it is that tenant's."""
        query = sa.select(table).where(table.c.id == id_)
        if tenant is not None:
            query = query.where(table.c.tenant == tenant)
        with self.engine.connect() as conn:
            found = conn.execute(query).mappings().first()
        return dict(found) if found else None

    def page(self, table: sa.Table, after: str | None, limit: int, newest_first: bool = True,
             where: Any = None, tenant: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` rows after the row ``after`` (by creation order), and whether more follow."""
        query = sa.select(table)
        if where is not None:
            query = query.where(where)
        if tenant is not None:
            query = query.where(table.c.tenant == tenant)
        with self.engine.connect() as conn:
            if after:
                seq = conn.execute(sa.select(table.c.seq).where(table.c.id == after, *(
                    [table.c.tenant == tenant] if tenant is not None else []))).scalar()
                if seq is not None:
                    query = query.where(table.c.seq < seq if newest_first else table.c.seq > seq)
            order = table.c.seq.desc() if newest_first else table.c.seq.asc()
            rows = conn.execute(query.order_by(order).limit(limit + 1)).mappings().all()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    # -- batches -----------------------------------------------------------------------------

    def transition(self, batch_id: str, from_status: tuple[str, ...] | None, unstopped: bool = False,
                   **fields: Any) -> bool:
        """Update a batch only while its status is one of ``from_status`` (and, with
        ``unstopped``, no cancel or expiry is asked of it); returns whether it did."""
        query = self.batches.update().where(self.batches.c.id == batch_id)
        if from_status is not None:
            query = query.where(self.batches.c.status.in_(from_status))
        if unstopped:
            query = query.where(self.batches.c.stop.is_(None))
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

    def tenant_usage(self, tenant: str, unfinished: tuple[str, ...]) -> tuple[int, int]:
        """(bytes of files stored, unfinished batches) of ``tenant``: what its quotas count."""
        with self.engine.connect() as conn:
            stored = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(self.files.c.bytes), 0))
                                  .where(self.files.c.tenant == tenant)).scalar()
            queued = conn.execute(sa.select(sa.func.count()).select_from(self.batches)
                                  .where(self.batches.c.tenant == tenant, self.batches.c.status.in_(unfinished))).scalar()
        return int(stored or 0), int(queued or 0)

    def expired_files(self, now: int, limit: int = 1000) -> list[str]:
        """Ids of files whose ``expires_at`` has passed."""
        f = self.files
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(f.c.id).where(f.c.expires_at.is_not(None), f.c.expires_at <= now)
                                     .order_by(f.c.seq).limit(limit)).scalars())

    def delete_file(self, file_id: str) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(self.files.delete().where(self.files.c.id == file_id)).rowcount == 1

    # -- the server lease --------------------------------------------------------------------

    def claim_lease(self, holder: str, ttl_s: float, now: float, place: str | None = None) -> str | None:
        """Take or renew the lease on this database's batches for ``ttl_s`` seconds; returns
        None when ``holder`` has it, else who does (a live server). An expired lease is taken,
        and so is one whose holder starts with ``place`` (a server of the same host and data
        dir, whose lock the caller now holds: that server is gone)."""
        lease = self.lease
        try:
            with self.engine.begin() as conn:
                row = conn.execute(sa.select(lease).where(lease.c.id == 1)).mappings().first()
                if row is None:
                    conn.execute(lease.insert().values(id=1, holder=holder, expires_at=now + ttl_s))
                    return None
                ours = row["holder"] == holder or (place is not None and row["holder"].startswith(place))
                if not ours and row["expires_at"] > now:
                    return row["holder"]
                taken = conn.execute(lease.update().where(lease.c.id == 1, lease.c.holder == row["holder"],
                                                          lease.c.expires_at == row["expires_at"])
                                     .values(holder=holder, expires_at=now + ttl_s)).rowcount
                return None if taken == 1 else "another server (it renewed its lease just now)"
        except sa.exc.IntegrityError:  # another server inserted the lease first
            return "another server (it took the lease just now)"

    def release_lease(self, holder: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.lease.delete().where(self.lease.c.id == 1, self.lease.c.holder == holder))

    def close(self) -> None:
        self.engine.dispose()
