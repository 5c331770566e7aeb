"""Tracing set-up from the OTEL_* variables (config/telemetry.py): the on/off decision, loud
refusals, the resource and sampler as the SDK reads them, spans reaching the console exporter and
a real OTLP/HTTP receiver, and the flush at a process's exit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from config import telemetry
from gateway import tracing
from tests.support.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no OTEL_* variable and no tracing, and leaves none behind."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    telemetry.shutdown()
    yield
    telemetry.shutdown()
    assert tracing.tracer() is None


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, ()),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
    ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
    ({"OTEL_TRACES_EXPORTER": " OTLP , console,otlp"}, ("otlp", "console")),
    ({"OTEL_TRACES_EXPORTER": "none"}, ()),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ("otlp",)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, ()),
    # An explicit exporter list wins over an endpoint set for another purpose.
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
     ("console",)),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
    ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
    ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "console"}, ("console",)),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     ("otlp",)),
    # The traces-specific protocol wins over the general one (grpc for the other signals).
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, ("otlp",)),
    # A protocol matters only to the OTLP exporter.
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("console",)),
])
def test_which_exporters_the_environment_asks_for(environ: dict[str, str],
                                                   expected: tuple[str, ...]) -> None:
    assert telemetry.exporters(environ) == expected


@pytest.mark.parametrize(("environ", "message"), [
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "unknown exporter 'jaeger'"),
    ({"OTEL_TRACES_EXPORTER": "otlp,zipkin"}, "unknown exporter 'zipkin'"),
    ({"OTEL_TRACES_EXPORTER": "none,console"}, "'none' cannot be combined"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"),
])
def test_what_tollgate_cannot_do_is_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message.replace("(", r"\(")):
        telemetry.exporters(environ)
    with pytest.raises(ImproperlyConfigured):
        telemetry.setup(environ=environ)
    assert tracing.tracer() is None


def test_a_misspelt_exporter_stops_the_settings_load() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import config.settings as s; print(s.TOLLGATE_TRACE_EXPORTERS)"],
        cwd=ROOT, env={**os.environ, "OTEL_TRACES_EXPORTER": "otpl"}, capture_output=True,
        text=True, timeout=60)
    assert result.returncode != 0
    assert "OTEL_TRACES_EXPORTER: unknown exporter 'otpl'" in result.stderr


def test_off_by_default() -> None:
    assert telemetry.setup() is None
    assert tracing.tracer() is None


def test_console_exporter_gets_a_span(capsys: pytest.CaptureFixture[str]) -> None:
    provider = telemetry.setup(environ={"OTEL_TRACES_EXPORTER": "console"})
    assert provider is not None
    assert telemetry.setup() is provider  # once per process
    tracer = tracing.tracer()
    assert tracer is not None
    with tracer.start_as_current_span("gateway.request",
                                      attributes={"tollgate.request_id": "req_console"}):
        with tracer.start_as_current_span("quota.reserve"):
            pass
    telemetry.shutdown()  # flushes the batch
    assert tracing.tracer() is None
    out = capsys.readouterr().out
    # The console exporter prints each span as an indented JSON object.
    decoder, spans, at = json.JSONDecoder(), [], 0
    while (start := out.find("{", at)) != -1:
        span, at = decoder.raw_decode(out, start)
        spans.append(span)
    by_name = {span["name"]: span for span in spans}
    assert set(by_name) == {"gateway.request", "quota.reserve"}
    request = by_name["gateway.request"]
    assert request["attributes"] == {"tollgate.request_id": "req_console"}
    assert request["resource"]["attributes"]["service.name"] == "tollgate-gateway"
    assert by_name["quota.reserve"]["parent_id"] == request["context"]["span_id"]


def test_resource_and_sampler_come_from_the_standard_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,team=edge")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = telemetry.setup(service_name="tollgate-worker")
    attributes = provider.resource.attributes
    assert attributes["service.name"] == "tollgate-worker"  # the process's default
    assert (attributes["deployment.environment"], attributes["team"]) == ("staging", "edge")
    assert provider.sampler.get_description() == "AlwaysOffSampler"
    with tracing.tracer().start_as_current_span("gateway.request") as span:
        assert not span.is_recording()


@pytest.mark.parametrize(("variables", "service"), [
    ({"OTEL_SERVICE_NAME": "edge-gateway"}, "edge-gateway"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"}, "from-attributes"),
    # OTEL_SERVICE_NAME wins over the attribute list, as the specification says.
    ({"OTEL_SERVICE_NAME": "named", "OTEL_RESOURCE_ATTRIBUTES": "service.name=listed"}, "named"),
])
def test_the_service_name_can_be_set(monkeypatch: pytest.MonkeyPatch,
                                     variables: dict[str, str], service: str) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = telemetry.setup()
    assert provider.resource.attributes["service.name"] == service
    assert provider.sampler.get_description() == "TraceIdRatioBased{0.25}"


def test_spans_reach_an_otlp_http_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-token=abc123")
        assert telemetry.setup() is not None
        with tracing.tracer().start_as_current_span(
                "gateway.request", attributes={"tollgate.request_id": "req_otlp"}):
            pass
        telemetry.shutdown()
        [post] = receiver.posts
        assert post["path"] == "/v1/traces"
        assert post["headers"]["content-type"] == "application/x-protobuf"
        assert post["headers"]["x-collector-token"] == "abc123"
        [span] = receiver.spans()
    assert (span.name, span.service, span.attributes) == (
        "gateway.request", "tollgate-gateway", {"tollgate.request_id": "req_otlp"})


def test_spans_are_flushed_when_the_process_exits() -> None:
    """A process that ends normally exports what its batch still holds (the provider's exit
    hook): the batch's own timer (10 minutes here) never fires."""
    code = ("from config import telemetry; from gateway import tracing; "
            "assert telemetry.setup() is not None; "
            "span = tracing.tracer().start_span('at-exit'); span.end(); print('made')")
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                   OTEL_BSP_SCHEDULE_DELAY="600000", OTEL_SERVICE_NAME="exit-test")
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "made"
        [span] = receiver.spans()
    assert (span.name, span.service) == ("at-exit", "exit-test")


def test_the_lifespan_shutdown_flushes_the_spans(capsys: pytest.CaptureFixture[str]) -> None:
    """uvicorn's workers die of the SIGTERM they re-raise after a graceful shutdown, so exit
    hooks never run there: the router, as config/asgi.py builds it when tracing, flushes them
    at the lifespan's shutdown (its `on_shutdown`), and passes every request on as before."""
    import asyncio

    from gateway.asgi import GatewayRouter

    assert telemetry.setup(environ={"OTEL_TRACES_EXPORTER": "console"}) is not None
    seen: list[str] = []

    async def django(scope: dict, receive: object, send: object) -> None:
        seen.append(scope["type"])

    router = GatewayRouter(django, {}, on_shutdown=(telemetry.shutdown,))  # type: ignore[arg-type]

    async def run() -> list[dict]:
        await router({"type": "http", "path": "/console/"}, None, None)  # type: ignore[arg-type]
        inbox = asyncio.Queue()
        for kind in ("lifespan.startup", "lifespan.shutdown"):
            inbox.put_nowait({"type": kind})
        sent: list[dict] = []

        async def send(message: dict) -> None:
            if message["type"] == "lifespan.startup.complete":
                tracing.tracer().start_span("last-request").end()
            sent.append(message)

        await router({"type": "lifespan"}, inbox.get, send)
        return sent

    sent = asyncio.run(run())
    assert seen == ["http"]
    assert [m["type"] for m in sent] == ["lifespan.startup.complete",
                                         "lifespan.shutdown.complete"]
    assert tracing.tracer() is None  # shut down
    assert '"name": "last-request"' in capsys.readouterr().out
