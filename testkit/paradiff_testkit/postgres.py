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
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def postgres_server(timeout_s: float = 60, fsync: bool = False):
    """Yields the database URL (postgresql://paradiff@127.0.0.1:PORT/paradiff) of a PostgreSQL server started for
    the caller; bounded waits, and the server's log in the error when it does not start. `fsync`: commits wait for
    the disk, as PostgreSQL's defaults have them (benchmarks); tests leave it off."""
    folder = binaries()
    if folder is None:
        raise RuntimeError("PostgreSQL's initdb is not installed (Debian: apt-get install postgresql)")
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="paradiff-pg-"))  # /tmp: the server's user can reach it
    data = root / "data"
    if user:
        os.chown(root, user["user"], user["group"])
    port = _free_port()
    subprocess.run([str(folder / "initdb"), "-D", str(data), "-U", "paradiff", "-A", "trust", "-E", "UTF8",
                    "--no-sync"], check=True, capture_output=True, timeout=timeout_s, cwd=root, **user)
    log = open(root / "log", "wb")  # noqa: SIM115 - the server's output, read when it fails
    server = subprocess.Popen([str(folder / "postgres"), "-D", str(data), "-p", str(port), "-k", str(root),
                               "-c", "listen_addresses=127.0.0.1", "-c", f"fsync={'on' if fsync else 'off'}"],
                              stdout=log, stderr=log, cwd=root, **user)
    try:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(host="127.0.0.1", port=port, user="paradiff", dbname="postgres",
                                     connect_timeout=5, autocommit=True) as connection:
                    connection.execute("CREATE DATABASE paradiff")
                break
            except psycopg.OperationalError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("PostgreSQL did not start: " + (root / "log").read_text()[-2000:]) from None
                time.sleep(0.1)
        yield f"postgresql://paradiff@127.0.0.1:{port}/paradiff"
    finally:
        server.send_signal(signal.SIGINT)  # a fast shutdown: its clients' sessions are ended, not waited for
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def new_database(url: str) -> str:
    """A new, empty database on the server at `url` (postgres_server's): its URL."""
    import secrets

    import psycopg

    name = "jobs_" + secrets.token_hex(4)
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + "/" + name
