"""A PostgreSQL server of the test's own (Debian's postgresql package, started by hand on loopback), for the job
store's database-server tests: a fresh cluster in a temporary folder, trust authentication on 127.0.0.1 only,
stopped and removed at the end. PostgreSQL refuses to run as root; as root the server runs as the `postgres` user
the package creates (the process itself: the signal that stops it reaches it)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from paradiff.distributed.spawn import free_port


def binaries() -> Path | None:
    """The folder of initdb and postgres: on PATH, else Debian's /usr/lib/postgresql/<version>/bin; None without."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(folders[-1]).parent if folders else None


def _server_user() -> dict:
    """subprocess's arguments that run a program as the server's user (none: as this one)."""
    if os.geteuid() != 0:
        return {}
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("PostgreSQL does not run as root and there is no postgres user") from None
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


class PostgresServer:
    """A PostgreSQL cluster in a folder of its own, served on a loopback port; stop() and start() again (a database
    server restarting under its clients)."""

    def __init__(self, root: Path, fsync: bool, timeout_s: float) -> None:
        self.root, self.fsync, self.timeout_s = root, fsync, timeout_s
        self.folder, self.user = binaries(), _server_user()
        self.port = free_port()
        self.url = f"postgresql://paradiff@127.0.0.1:{self.port}/paradiff"
        self.process: subprocess.Popen | None = None
        subprocess.run([str(self.folder / "initdb"), "-D", str(root / "data"), "-U", "paradiff", "-A", "trust", "-E",
                        "UTF8", "--no-sync"], check=True, capture_output=True, timeout=timeout_s, cwd=root,
                       **self.user)

    def start(self) -> None:
        """Start the server and wait (bounded) until it takes a connection."""
        import psycopg

        with open(self.root / "log", "ab") as log:
            self.process = subprocess.Popen(
                [str(self.folder / "postgres"), "-D", str(self.root / "data"), "-p", str(self.port), "-k",
                 str(self.root), "-c", "listen_addresses=127.0.0.1", "-c", f"fsync={'on' if self.fsync else 'off'}"],
                stdout=log, stderr=log, cwd=self.root, **self.user)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                with psycopg.connect(host="127.0.0.1", port=self.port, user="paradiff", dbname="postgres",
                                     connect_timeout=5):
                    return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("PostgreSQL did not start: " + (self.root / "log").read_text()[-2000:]) from None
                time.sleep(0.1)

    def new_database(self, name: str | None = None) -> str:
        """A new, empty database (`name`, else a random one): its URL."""
        import secrets

        import psycopg

        name = name or "jobs_" + secrets.token_hex(4)
        with psycopg.connect(host="127.0.0.1", port=self.port, user="paradiff", dbname="postgres",
                             autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        """A fast shutdown (its clients' sessions are ended, not waited for); returns once the process has ended."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


@contextmanager
def postgres_server(timeout_s: float = 60, fsync: bool = False):
    """Yields a PostgresServer started for the caller, with an empty database `paradiff` (its `url`:
    postgresql://paradiff@127.0.0.1:PORT/paradiff); bounded waits, and the server's log in the error when it does not
    start. `fsync`: commits wait for the disk, as PostgreSQL's defaults have them (benchmarks); tests leave it off."""
    if binaries() is None:
        raise RuntimeError("PostgreSQL's initdb is not installed (Debian: apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="paradiff-pg-"))  # /tmp: the server's user can reach it
    try:
        user = _server_user()
        if user:
            os.chown(root, user["user"], user["group"])
        server = PostgresServer(root, fsync, timeout_s)
        server.start()
        try:
            server.new_database("paradiff")
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
