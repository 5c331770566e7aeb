"""Tarpit HTTP receivers on loopback: servers that answer a request slowly on purpose, so that a
client bounded only per read (each read gets its timeout afresh) never finishes.

    continue   `HTTP/1.1 100 Continue` every `interval` seconds, for ever
    head       a `200 OK` response head trickled one byte every `interval` seconds
    body       a complete `200 OK` head at once, then its body one byte every `interval` seconds

`abort()` closes every connection (a watchdog's way to free a client stuck on one)."""
from __future__ import annotations

import socket
import threading
from typing import Literal

Mode = Literal["continue", "head", "body"]

_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\n"


class Tarpit:
    def __init__(self, mode: Mode, interval: float = 1.0) -> None:
        self.mode = mode
        self.interval = interval
        self.connections = 0  # how many clients have connected
        self.aborted = False
        self._stop = threading.Event()
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.getsockname()[1]}/hooks/tarpit"

    def __enter__(self) -> Tarpit:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._close_clients()
        self._server.close()

    def abort(self) -> None:
        """Close every connection now (the watchdog: the client under test overran)."""
        self.aborted = True
        self._close_clients()

    def _close_clients(self) -> None:
        with self._lock:
            for client in self._clients:
                try:
                    client.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                client.close()
            self._clients.clear()

    def _accept(self) -> None:
        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self.connections += 1
                self._clients.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            self._read_request_head(client)
            if self.mode == "continue":
                while not self._stop.wait(0):
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    if self._stop.wait(self.interval):
                        return
            payload = _HEAD if self.mode == "head" else b"x" * 1000
            if self.mode == "body":
                client.sendall(_HEAD)
            for byte in payload:
                if self._stop.wait(self.interval):
                    return
                client.sendall(bytes([byte]))
        except OSError:
            return  # the client went away (or abort() closed it)

    @staticmethod
    def _read_request_head(client: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(4096)
            if not chunk:
                raise OSError("client closed")
            data += chunk
