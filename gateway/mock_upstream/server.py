"""Running the mock upstream: blocking (the CLI), in a background thread, or as a subprocess."""
from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import uvicorn

from gateway.mock_upstream.app import app

APP_IMPORT_STRING = "gateway.mock_upstream.app:app"
# The directory holding the `gateway` package, so a subprocess can import it from any cwd.
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the usual small race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def run(host: str = "127.0.0.1", port: int = 8099, workers: int = 1, log_level: str = "warning",
        access_log: bool = False) -> None:
    """Serve until interrupted. The access log is off by default: it costs a large share of the
    per-request time and the benchmark is what this server is for."""
    uvicorn.run(
        # Several workers need an import string (each worker imports the app itself).
        APP_IMPORT_STRING if workers > 1 else app,
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=log_level,
        access_log=access_log,
        backlog=4096,
        timeout_keep_alive=30,
    )


class MockUpstream:
    """A running mock upstream; a context manager that stops it on exit."""

    def __init__(self, host: str, port: int, stop: Callable[[], None]) -> None:
        self.host = host
        self.port = port
        self._stop = stop

    @property
    def url(self) -> str:
        """Root URL, e.g. for /mock/usage."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What to give the openai SDK as base_url."""
        return f"{self.url}/v1"

    def stop(self) -> None:
        self._stop()

    def __enter__(self) -> MockUpstream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def start_in_thread(host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 10.0,
                    log_level: str = "warning") -> MockUpstream:
    """Serve in a daemon thread of this process (its own event loop); port 0 picks a free port
    with no race since the socket is bound here and handed to uvicorn."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    bound_port = int(sock.getsockname()[1])
    config = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="on",
                            log_level=log_level, access_log=False, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name=f"mock-upstream-{bound_port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the mock upstream thread did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return MockUpstream(host, bound_port, stop)


def wait_until_ready(host: str, port: int, timeout: float,
                     alive: Callable[[], bool] = lambda: True) -> None:
    """Poll GET /mock/usage until it answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        if not alive():
            raise RuntimeError(f"the mock upstream on port {port} exited during startup")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=1.0)
            try:
                conn.request("GET", "/mock/usage")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mock upstream on port {port} did not answer within {timeout}s")
        time.sleep(0.05)


def start_subprocess(port: int | None = None, host: str = "127.0.0.1", workers: int = 1,
                     startup_timeout: float = 15.0, log_level: str = "warning") -> MockUpstream:
    """`python -m gateway.mock_upstream` in a child process, returned once it answers."""
    chosen = port if port is not None else free_port(host)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.mock_upstream", "--host", host, "--port", str(chosen),
         "--workers", str(workers), "--log-level", log_level],
        env=env,
    )

    def stop() -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    try:
        wait_until_ready(host, chosen, startup_timeout, alive=lambda: process.poll() is None)
    except BaseException:
        stop()
        raise
    return MockUpstream(host, chosen, stop)
