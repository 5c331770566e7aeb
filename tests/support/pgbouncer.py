"""A real PgBouncer in transaction mode in front of the test session's PostgreSQL.

The system's `pgbouncer` (Debian's package; `.ci/ensure-pgbouncer`, run by `make test`, installs
it when missing) listens on a free loopback port and pools into the embedded server's Unix socket
(config/embedded.py). PgBouncer refuses to run as root: started as root, it is told to switch
(`-u`) to the user owning the PostgreSQL data directory, who can reach its socket; its folder is
given to that user.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from config.embedded import free_port


@dataclass
class PgBouncer:
    port: int
    folder: Path
    process: subprocess.Popen[bytes]

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def log(self) -> Path:
        return self.folder / "pgbouncer.log"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # shut down at once, connections closed
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None)
    if found is None:
        raise RuntimeError("pgbouncer is not installed: run .ci/ensure-pgbouncer "
                           "(apt-get install -y pgbouncer)")
    return found


def start_pgbouncer(folder: Path, pg_folder: Path, *, pool_size: int = 10) -> PgBouncer:
    """PgBouncer in transaction mode on a free port, every database forwarded to the PostgreSQL
    whose socket is in `pg_folder` as user postgres (`auth_type = any`: the embedded server
    trusts local connections, and the tests' clients log in as postgres anyway)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    run_as: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwuid(pg_folder.stat().st_uid)
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        run_as = ["-u", owner.pw_name]
    sockets = sorted(pg_folder.glob(".s.PGSQL.*[0-9]"))
    if not sockets:
        raise RuntimeError(f"no PostgreSQL socket in {pg_folder}")
    pg_port = sockets[0].name.rsplit(".", 1)[1]
    config = folder / "pgbouncer.ini"
    config.write_text(f"""\
[databases]
* = host={pg_folder} port={pg_port} user=postgres

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 200
server_reset_query =
ignore_startup_parameters = extra_float_digits
admin_users = postgres
stats_users = postgres
logfile = {folder / 'pgbouncer.log'}
pidfile = {folder / 'pgbouncer.pid'}
""")
    # Its output (what it could not log to its file: a refused configuration) goes to a file
    # this process opens, whatever the user it switches to may write.
    with (folder / "pgbouncer.out").open("wb") as out:
        process = subprocess.Popen([pgbouncer_binary(), *run_as, str(config)],
                                   stdout=out, stderr=subprocess.STDOUT)
    bouncer = PgBouncer(port, folder, process)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = (folder / "pgbouncer.out").read_text(errors="replace")
            raise RuntimeError(f"pgbouncer exited ({process.returncode}): {log[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return bouncer
        time.sleep(0.1)
    bouncer.stop()
    raise RuntimeError("pgbouncer did not start listening")


def show(bouncer: PgBouncer, command: str) -> list[dict[str, object]]:
    """A SHOW command on PgBouncer's admin console (simple query protocol only)."""
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=bouncer.port, user="postgres", dbname="pgbouncer",
                         autocommit=True, prepare_threshold=None,
                         cursor_factory=psycopg.ClientCursor) as conn:
        cursor = conn.execute(command)
        names = [column.name for column in cursor.description or []]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


@pytest.fixture(scope="session")
def pgbouncer(django_db_setup: None) -> Iterator[PgBouncer]:
    """One PgBouncer for the session, in front of its PostgreSQL (the test database exists:
    pytest-django made it). Its folder is not under pytest's temporary directory, which only
    root may enter: PgBouncer, switched to another user, must write its log there."""
    from django.conf import settings

    folder = Path(tempfile.mkdtemp(prefix="tgpgb-", dir="/tmp"))
    try:
        bouncer = start_pgbouncer(folder, Path(settings.DATA_DIR) / "pg")
        yield bouncer
        bouncer.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
