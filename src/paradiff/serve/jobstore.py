"""The store of `paradiff serve`'s video jobs (serve/jobs.py): their parameters, state, progress, errors and result
files, in a SQLite file or a database server, through SQLAlchemy.

`--jobs-db` is a file path (SQLite in WAL mode; the default, `<--out>/jobs.db`) or a database URL: `postgresql://user@
host/db` (psycopg, the `postgres` extra; the password from PGPASSWORD or ~/.pgpass rather than the command line),
or `sqlite:///path`. Three tables:
- `jobs`: one row per job;
- `job_results`: the files of completed jobs (the MP4 and its thumbnail), in the database itself, so that any server
  sharing the store answers any job's content, on any machine;
- `job_owners`: the servers that have the store open (below).

Several servers may share one store (the meshes of `paradiff serve --ray`, on one node or many): each store is an
owner (a random id) that claims a queued job before it submits it (one UPDATE, so two owners never run one job). An
owner's row says where it runs (its host and process) and carries a counter it raises every BEAT_S seconds from a
thread of its own. Another owner tells a dead one from a live one (`alive`):
- on the same machine, at once: the process is gone (or a zombie, or another process now has its id);
- on another machine, by the counter: it has not moved for LEASE_S seconds of the observer's own clock (no two
  machines' clocks are compared).
An owner whose own counter has not risen for half the lease (the database away from it) starts none of the jobs it
claimed (`cut_off`): the others may count it dead at the full lease and run them. A store closed cleanly deletes its
row. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from sqlalchemy import (BigInteger, Column, Float, Integer, LargeBinary, MetaData, Table, Text, and_, bindparam,
                        create_engine, delete, event, func, insert, inspect, or_, select, update)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError

from paradiff.serve.protocol import RequestError

BEAT_S = 2.0  # how often an owner raises its counter
LEASE_S = 20.0  # how long another machine's owner may leave it unmoved before it counts as dead
CONNECT_S = 10  # how long a connection to a database server may take
DRIVERS = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg"}  # libpq's URL names: psycopg 3

METADATA = MetaData()
JOBS = Table(
    "jobs", METADATA,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("id", Text, unique=True, nullable=False),
    Column("kind", Text, nullable=False),
    Column("model", Text, nullable=False),
    Column("params", Text, nullable=False),
    Column("size", Text, nullable=False),
    Column("seconds", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("progress", Integer, nullable=False, server_default="0"),
    Column("created_at", BigInteger, nullable=False),
    Column("started_at", Float),
    Column("completed_at", BigInteger),
    Column("error", Text),
    Column("files", Text),
    Column("expires_at", BigInteger),
    Column("expired", Integer, nullable=False, server_default="0"),
    Column("deleted_at", BigInteger),
    Column("owner", Text),
    sqlite_autoincrement=True,
)
RESULTS = Table(
    "job_results", METADATA,
    Column("job_id", Text, primary_key=True),
    Column("variant", Text, primary_key=True),
    Column("mime", Text, nullable=False),
    Column("data", LargeBinary, nullable=False),
)
OWNERS = Table(
    "job_owners", METADATA,
    Column("owner", Text, primary_key=True),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started", Text),
    Column("beat", BigInteger, nullable=False),
)


class StoreError(RequestError):
    """The store's database cannot be reached, or failed a statement: a request answers 503 (retry later), without
    the store's address or the driver's words (internal details, for the console: `where`, `reason`); rank 0's side
    of the jobs waits for it (serve/jobs.py)."""

    retry_after = 5

    def __init__(self, url: str, exc: Exception) -> None:
        self.where, self.reason = shown(url), " ".join(str(getattr(exc, "orig", None) or exc).split())
        super().__init__(503, "the video jobs' store cannot be reached; retry later", code="store_unavailable")


def store_url(value: str | Path) -> str:
    """`--jobs-db` as a SQLAlchemy URL: a path is a SQLite file (absolute, so that servers started elsewhere find
    it); postgresql:// and postgres:// go through psycopg 3. ValueError for a URL of another database or not one."""
    text = str(value)
    if "://" not in text:
        return "sqlite:///" + str(Path(text).resolve())
    try:
        url = make_url(text)
    except ArgumentError:
        raise ValueError(f"--jobs-db {text!r}: not a database URL; expected a file path, postgresql://user@host/db "
                         "or sqlite:///path") from None
    backend = url.get_backend_name()
    if backend not in ("sqlite", "postgresql", "postgres"):
        raise ValueError(f"--jobs-db {shown(text)}: {backend} databases are not supported; expected a file path, "
                         "postgresql://user@host/db or sqlite:///path")
    if url.drivername in DRIVERS:
        url = url.set(drivername=DRIVERS[url.drivername])
    return url.render_as_string(hide_password=False)


def shown(url: str) -> str:
    """A URL as printed: without its password (and its driver, as the user wrote it)."""
    try:
        if "://" not in url:
            return url
        parsed = make_url(url)
        return parsed.set(drivername=parsed.get_backend_name()).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _engine(url: str) -> Engine:
    if make_url(url).get_backend_name() != "sqlite":
        # pre-ping: a database server restarted, a dead connection is replaced; a server that does not answer is an
        # error in CONNECT_S, not a wait of the system's TCP timeout
        return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_S})
    path = make_url(url).database
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(connection, _record) -> None:  # noqa: ANN001 - SQLAlchemy's DBAPI objects
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")  # WAL: a committed job survives a kill of the process
        cursor.close()

    return engine


def _host() -> str:
    """This machine and process namespace: two owners with the same key can see each other's processes."""
    parts = [socket.gethostname()]
    try:  # Linux: this boot of the machine, and the process namespace (a container's own)
        parts += [Path("/proc/sys/kernel/random/boot_id").read_text().strip(), str(os.stat("/proc/self/ns/pid").st_ino)]
    except OSError:
        pass
    return "/".join(parts)


def _process_start(pid: int) -> str | None:
    """When process `pid` started (Linux's clock ticks since boot), "" for a zombie, None when there is none or this
    system has no /proc (then only the process id is compared)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) ": the state is field 3, the start field 22
    return "" if fields[0] in ("Z", "X") else fields[19]


def _process_alive(pid: int, started: str | None) -> bool:
    if Path("/proc/self/stat").exists():
        now = _process_start(pid)
        return bool(now) and (started is None or now == started)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, another user's
    return True


def _statements() -> SimpleNamespace:
    """The store's statements, built once (SQLAlchemy then compiles each once per database): an UPDATE built per
    call cost 0.17 ms against 0.02 ms built once (SQLite, this 2-core machine), and a job's life runs about 40."""
    job, owner, jobs, owners, results = bindparam("job"), bindparam("me"), JOBS.c, OWNERS.c, RESULTS.c
    live = jobs.deleted_at.is_(None)
    return SimpleNamespace(
        get=select(JOBS).where(jobs.id == job),
        add=insert(JOBS),
        queued=select(JOBS).where(jobs.status == "queued", live, or_(jobs.owner.is_(None), jobs.owner == owner))
        .order_by(jobs.seq),
        claim=update(JOBS).where(jobs.id == job, jobs.status == "queued", jobs.owner.is_(None), live)
        .values(owner=owner),
        release=update(JOBS).where(jobs.id == job, jobs.owner == owner, jobs.status == "queued").values(owner=None),
        disown=update(JOBS).where(jobs.id == job, jobs.owner == bindparam("was")).values(owner=None),
        count_queued=select(func.count().label("n")).select_from(JOBS).where(jobs.status == "queued", live),
        started=update(JOBS).where(jobs.id == job, jobs.status == "queued")
        .values(status="in_progress", started_at=bindparam("at")),
        progress=update(JOBS).where(jobs.id == job, jobs.status == "in_progress", live,
                                    jobs.progress < bindparam("percent")).values(progress=bindparam("percent")),
        completed=update(JOBS).where(jobs.id == job, live).values(
            status="completed", progress=100, completed_at=bindparam("at"), files=bindparam("listed"),
            expires_at=bindparam("until")),
        failed=update(JOBS).where(jobs.id == job, live).values(status="failed", completed_at=bindparam("at"),
                                                               error=bindparam("why")),
        deleted=update(JOBS).where(jobs.id == job).values(deleted_at=bindparam("at"), files=None),
        expired=update(JOBS).where(jobs.id == job).values(expired=1, expires_at=bindparam("until")),
        orphans=select(jobs.id, jobs.status, jobs.owner).where(
            live, or_(jobs.status == "in_progress", and_(jobs.status == "queued", jobs.owner.is_not(None)))),
        add_result=insert(RESULTS),
        result=select(results.data, results.mime).where(results.job_id == job, results.variant == bindparam("kind")),
        drop_results=delete(RESULTS).where(results.job_id == job),
        add_owner=insert(OWNERS),
        owner=select(OWNERS).where(owners.owner == owner),
        owners=select(owners.owner),
        beat=update(OWNERS).where(owners.owner == owner).values(beat=owners.beat + 1),
        drop_owner=delete(OWNERS).where(owners.owner == owner),
        drop_dead=delete(OWNERS).where(owners.owner == owner, owners.beat == bindparam("beat")),
    )


SQL = _statements()


class JobStore:
    """The jobs of one store, shared by the HTTP thread and rank 0's loop: one connection of its own in autocommit
    (each statement its own transaction, under a lock), and a transaction from the engine's pool where several
    statements go together (a result's files with its job's state)."""

    def __init__(self, where: str | Path, beat_s: float | None = BEAT_S, lease_s: float = LEASE_S,
                 clock: Callable[[], float] = time.monotonic, host: str | None = None) -> None:
        """`where`: a file path or a database URL (store_url). `beat_s`: how often this owner's counter rises (None:
        only when beat() is called); `lease_s`, `clock`: how long, by which clock, another machine's owner's counter
        may stay still before that owner counts as dead; `host`: this owner's machine (default: this one's)."""
        self.url = store_url(where)
        self.engine = _engine(self.url)
        self.owner = secrets.token_hex(8)
        self.host = host or _host()
        self.lease_s, self.clock = lease_s, clock
        self._seen: dict[str, tuple[int, float]] = {}  # another owner -> its counter, when it was seen to change
        self._beaten = clock()  # when this owner's counter last rose (its row written)
        for attempt in range(3):  # servers starting together on a new database: one creates the tables
            try:
                METADATA.create_all(self.engine)
                break
            except SQLAlchemyError:
                if attempt == 2:
                    raise
        with self.engine.begin() as connection:
            if "owner" not in {column["name"] for column in inspect(connection).get_columns("jobs")}:
                connection.exec_driver_sql("ALTER TABLE jobs ADD COLUMN owner TEXT")  # a store from before owners
            connection.execute(SQL.add_owner, self._owner_row())
        self._lock = threading.Lock()
        self._connection = None  # one of its own, in autocommit, opened by the first statement (_execute)
        if self.engine.dialect.name == "sqlite":
            self._import_result_files()
        self._stop = threading.Event()
        self._beating = None
        if beat_s is not None:
            self._beating = threading.Thread(target=self._beat_every, args=(beat_s,), name="paradiff-jobs-beat",
                                             daemon=True)
            self._beating.start()

    def _owner_row(self) -> dict:
        """This owner's row of job_owners: where it runs, its counter at 0."""
        return {"owner": self.owner, "host": self.host, "pid": os.getpid(), "started": _process_start(os.getpid()),
                "beat": 0}

    def _import_result_files(self) -> None:
        """A SQLite store from before results were kept in it has them as files under `jobs/<id>/` beside it: they
        move into job_results (each job in one transaction, which a second server opening the store at once finds
        done), and the folders go."""
        folder = Path(make_url(self.url).database).parent / "jobs"
        if not folder.is_dir():
            return
        rows = self._execute(select(JOBS.c.id, JOBS.c.files).where(JOBS.c.files.like('%"path"%')))
        for row in rows:
            files = json.loads(row["files"])
            found = [dict(file, data=(folder / file["path"]).read_bytes()) for file in files
                     if (folder / file["path"]).is_file()]
            listed = [{"variant": file["variant"], "mime": file["mime"], "bytes": len(file["data"])} for file in found]
            with self._transaction() as connection:
                moved = connection.execute(update(JOBS).where(JOBS.c.id == row["id"], JOBS.c.files == row["files"])
                                           .values(files=json.dumps(listed))).rowcount
                if moved and found:
                    connection.execute(SQL.add_result, [{"job_id": row["id"], "variant": file["variant"],
                                                         "mime": file["mime"], "data": file["data"]} for file in found])
            shutil.rmtree(folder / row["id"], ignore_errors=True)
        if not any(folder.iterdir()):
            folder.rmdir()

    def _execute(self, statement, values: dict | None = None):  # noqa: ANN001, ANN202 - SQLAlchemy's objects
        """One statement in its own transaction: its rows (dicts) for a query, else how many rows it changed. A
        connection the database dropped (a restart) is opened again, once."""
        with self._lock:
            for attempt in range(2):
                try:
                    if self._connection is None:
                        self._connection = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
                    result = self._connection.execute(statement, values or {})
                    return [dict(row._mapping) for row in result] if result.returns_rows else result.rowcount
                except SQLAlchemyError as exc:
                    self._drop_connection()
                    if attempt or not (isinstance(exc, DBAPIError) and exc.connection_invalidated):
                        raise StoreError(self.url, exc) from None
        raise AssertionError("unreachable")

    def _drop_connection(self) -> None:
        """After an error the next statement opens a new connection: SQLAlchemy's own reconnection of this one would
        not be in autocommit (its writes then never committed, holding their rows' locks)."""
        if self._connection is not None:
            try:
                self._connection.close()
            except SQLAlchemyError:
                pass
            self._connection = None

    @contextmanager
    def _transaction(self):  # noqa: ANN202 - SQLAlchemy's connection
        """Several statements in one transaction, on a connection of the engine's pool (StoreError when it fails)."""
        try:
            with self.engine.begin() as connection:
                yield connection
        except SQLAlchemyError as exc:
            raise StoreError(self.url, exc) from None

    # -- owners ---------------------------------------------------------------------------------------------------
    def _beat_every(self, beat_s: float) -> None:
        while not self._stop.wait(beat_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - the database is away for a while: the next beat tries again
                continue

    def beat(self) -> None:
        """This owner's counter rises: it is alive (seen from other machines). An owner the others found dead (cut
        off from the database past the lease: they failed its running jobs and released its claims) writes its row
        again."""
        if self._execute(SQL.beat, {"me": self.owner}) == 0:
            self._execute(SQL.add_owner, self._owner_row())
        self._beaten = self.clock()

    def cut_off(self) -> bool:
        """Whether this owner's counter has not risen for half the lease: the others may soon count it dead and
        take the jobs it claimed, so it must not start them (serve/jobs.py withdraws them)."""
        return self.clock() - self._beaten > self.lease_s / 2

    def close(self) -> None:
        """This owner is gone: its row goes (the others then take what it held), and the connections."""
        self._stop.set()
        if self._beating is not None:
            self._beating.join()
        try:
            self._execute(SQL.drop_owner, {"me": self.owner})
        except StoreError:
            pass  # the database is away: the others find this owner dead by its process or its still counter
        with self._lock:
            self._drop_connection()
        self.engine.dispose()

    def alive(self, owner: str | None) -> bool:
        """Whether the store `owner` is open in a process that runs (module docstring)."""
        if owner is None:
            return False
        if owner == self.owner:
            return True
        rows = self._execute(SQL.owner, {"me": owner})
        if not rows:
            return False  # closed, or found dead before
        row = rows[0]
        if row["host"] == self.host:
            alive = _process_alive(row["pid"], row["started"])
        else:
            now = self.clock()
            seen = self._seen.get(owner)
            if seen is None or seen[0] != row["beat"]:
                self._seen[owner] = (row["beat"], now)
                alive = True
            else:
                alive = now - seen[1] < self.lease_s
        if not alive:
            self._execute(SQL.drop_dead, {"me": owner, "beat": row["beat"]})
            self._seen.pop(owner, None)
        return alive

    def owners(self) -> list[str]:
        """The owners with a row (open, or died without anyone having looked yet)."""
        return sorted(row["owner"] for row in self._execute(SQL.owners))

    def journal_mode(self) -> str | None:
        """SQLite's journal mode ("wal"); None on a database server."""
        if self.engine.dialect.name != "sqlite":
            return None
        with self.engine.connect() as connection:
            return connection.exec_driver_sql("PRAGMA journal_mode").scalar()

    # -- jobs -----------------------------------------------------------------------------------------------------
    def add(self, kind: str, model: str, params: dict, size: str, seconds: str, claimed: bool = False) -> dict:
        """A queued job; `claimed`: this owner's from the start (no other server sharing the store takes it)."""
        job_id = "video_" + secrets.token_hex(12)
        self._execute(SQL.add, {"id": job_id, "kind": kind, "model": model, "params": json.dumps(params), "size": size,
                                "seconds": seconds, "status": "queued", "created_at": int(time.time()),
                                "owner": self.owner if claimed else None})
        return self.get(job_id)

    def get(self, job_id: str) -> dict | None:
        rows = self._execute(SQL.get, {"job": job_id})
        return _job(rows[0]) if rows else None

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[dict], bool]:
        """Jobs not deleted, `order` "desc" (newest first) or "asc", after the job `after`; and whether more follow."""
        query = select(JOBS).where(JOBS.c.deleted_at.is_(None))
        if after is not None:
            seq = select(JOBS.c.seq).where(JOBS.c.id == after).scalar_subquery()
            query = query.where(JOBS.c.seq < seq if order == "desc" else JOBS.c.seq > seq)
        query = query.order_by(JOBS.c.seq.desc() if order == "desc" else JOBS.c.seq.asc()).limit(limit + 1)
        rows = self._execute(query)
        return [_job(row) for row in rows[:limit]], len(rows) > limit

    def queued(self) -> list[dict]:
        """The queued jobs no owner has claimed, and this owner's, in order."""
        return [_job(row) for row in self._execute(SQL.queued, {"me": self.owner})]

    def claim(self, job_id: str) -> bool:
        """This owner takes a queued job to run it; False when another owner had (or it left the queue)."""
        return self._execute(SQL.claim, {"job": job_id, "me": self.owner}) == 1

    def release(self, job_id: str) -> None:
        """A claimed job this owner will not run now (draining, or its scheduler is full): queued for any owner."""
        self._execute(SQL.release, {"job": job_id, "me": self.owner})

    def count_queued(self) -> int:
        return self._execute(SQL.count_queued)[0]["n"]

    def started(self, job_id: str) -> None:
        self._execute(SQL.started, {"job": job_id, "at": time.time()})

    def progress(self, job_id: str, percent: int) -> bool:
        """The running job's progress, if higher; False when it was not written (not higher, or the job is no
        longer running or was deleted)."""
        return self._execute(SQL.progress, {"job": job_id, "percent": percent}) == 1

    def completed(self, job_id: str, files: list[dict], expires_at: int | None) -> None:
        """The job's result files ({"variant", "mime", "data"}) kept, and the job completed, in one transaction."""
        listed = [{"variant": file["variant"], "mime": file["mime"], "bytes": len(file["data"])} for file in files]
        with self._transaction() as connection:
            done = connection.execute(SQL.completed, {"job": job_id, "at": int(time.time()),
                                                      "listed": json.dumps(listed), "until": expires_at}).rowcount
            if done and files:
                connection.execute(SQL.add_result, [{"job_id": job_id, "variant": file["variant"],
                                                     "mime": file["mime"], "data": file["data"]} for file in files])

    def result(self, job_id: str, variant: str) -> tuple[bytes, str] | None:
        """A completed job's file: (bytes, mime), None when it has no such file (or it expired)."""
        rows = self._execute(SQL.result, {"job": job_id, "kind": variant})
        return (bytes(rows[0]["data"]), rows[0]["mime"]) if rows else None

    def failed(self, job_id: str, code: str, message: str) -> None:
        self._execute(SQL.failed, {"job": job_id, "at": int(time.time()),
                                   "why": json.dumps({"code": code, "message": message})})

    def deleted(self, job_id: str) -> None:
        with self._transaction() as connection:
            connection.execute(SQL.deleted, {"job": job_id, "at": int(time.time())})
            connection.execute(SQL.drop_results, {"job": job_id})

    def orphans(self, message: str) -> list[str]:
        """The jobs of owners that died: those that were running are marked failed (code "server_restarted": a job
        that killed its server would kill the next one too), those claimed but not started are queued again for any
        owner. Returns the failed ones' ids."""
        alive: dict[str | None, bool] = {}
        failed = []
        for row in self._execute(SQL.orphans):
            if row["owner"] not in alive:
                alive[row["owner"]] = self.alive(row["owner"])
            if alive[row["owner"]]:
                continue
            if row["status"] == "in_progress":
                self.failed(row["id"], "server_restarted", message)
                failed.append(row["id"])
            else:
                self._execute(SQL.disown, {"job": row["id"], "was": row["owner"]})
        return failed

    def expire(self, policy: tuple[str, float], now: float) -> list[dict]:
        """Mark the completed results past the retention policy expired and delete their files; returns them."""
        kind, value = policy
        query = select(JOBS).where(JOBS.c.status == "completed", JOBS.c.expired == 0, JOBS.c.deleted_at.is_(None))
        if kind == "count":
            query = query.order_by(JOBS.c.completed_at.desc(), JOBS.c.seq.desc()).offset(int(value))
        else:
            query = query.where(JOBS.c.completed_at <= now - value)
        rows = self._execute(query)
        for row in rows:
            with self._transaction() as connection:
                connection.execute(SQL.expired, {"job": row["id"],
                                                 "until": min(int(now), row["expires_at"] or int(now))})
                connection.execute(SQL.drop_results, {"job": row["id"]})
        return [_job(row) for row in rows]


def _job(row: dict[str, Any]) -> dict:
    job = dict(row)
    job["params"] = json.loads(job["params"])
    job["error"] = json.loads(job["error"]) if job["error"] else None
    job["files"] = json.loads(job["files"]) if job["files"] else []
    return job
