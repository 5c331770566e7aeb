"""A tiny OTLP/HTTP trace receiver: a real HTTP server on loopback, in a thread, that records
every POST to /v1/traces and decodes its spans (protobuf, as the SDK's exporter sends them)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    service: str
    attributes: dict[str, Any]
    trace_id: str
    span_id: str
    parent_span_id: str


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    """Records POSTs (path, headers with lower-case names, body) and answers 200 with an empty export response."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.posts.append({
                        "path": self.path, "body": body,
                        "headers": {k.lower(): v for k, v in self.headers.items()}})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The value for OTEL_EXPORTER_OTLP_ENDPOINT (the exporter appends /v1/traces)."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[ReceivedSpan]:
        """Every span of every POST to /v1/traces so far."""
        found: list[ReceivedSpan] = []
        with self._lock:
            bodies = [post["body"] for post in self.posts if post["path"] == "/v1/traces"]
        for body in bodies:
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        found.append(ReceivedSpan(
                            span.name, resource.get("service.name", ""),
                            {a.key: _value(a.value) for a in span.attributes},
                            span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex()))
        return found

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans once `predicate(spans)` is true (AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver did not get the spans wanted: {spans}")
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
