"""OpenTelemetry tracing, set up from the standard OTEL_* variables: off unless they ask for it.

On when `OTEL_TRACES_EXPORTER` names `otlp` and/or `console`, or (with it unset) when an OTLP
endpoint is given (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`);
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keeps it off whatever else is set. The
SDK's own default exporter is otlp: Tollgate's is none, so a process started without these
variables makes no span and opens no connection.

What the SDK reads itself: the resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`; the
service name defaults to the one the process passes, "tollgate-gateway" for the gateway), the
sampler (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`), the batch processor
(`OTEL_BSP_*`) and the OTLP exporter (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, `_HEADERS`,
`_TIMEOUT`, `_COMPRESSION`, `_CERTIFICATE`...). The exporter speaks OTLP over HTTP with protobuf
(the one installed): a protocol other than http/protobuf is refused, not ignored.

Spans are exported by a BatchSpanProcessor (a thread of its own: the request never waits on the
collector) and flushed when the process ends: at the ASGI lifespan's shutdown in a uvicorn worker
(`shutdown`, run there by gateway.asgi.GatewayRouter as config/asgi.py wires it: uvicorn ends a
worker by raising again the SIGTERM it handled, so the process dies of it and exit hooks never
run), in Celery's pool processes at worker_process_shutdown (config/celery.py; they end without
exit hooks too), elsewhere by the provider's exit hook.

Per process, after the fork: each uvicorn worker imports config.asgi, which calls `setup`; Celery
calls it in each pool process (worker_process_init). `setup` then hands the provider to
gateway.tracing, whose spans the gateway's hot path makes.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from gateway import tracing

log = logging.getLogger(__name__)

GATEWAY_SERVICE = "tollgate-gateway"
EXPORTERS = ("otlp", "console")
# Values of OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL the installed exporter speaks.
_PROTOCOLS = ("http/protobuf",)

_provider: Any = None


def exporters(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The span exporters the environment asks for; () means tracing is off. An unknown
    exporter name or an OTLP protocol the installed exporter does not speak raises
    ImproperlyConfigured: a typo must not silently turn tracing off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if raw:
        names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
        unknown = [n for n in names if n not in (*EXPORTERS, "none")]
        if unknown:
            raise ImproperlyConfigured(
                f"OTEL_TRACES_EXPORTER: unknown exporter {', '.join(map(repr, unknown))}; "
                f"Tollgate supports {', '.join(EXPORTERS)} or none")
        if "none" in names:
            if len(names) > 1:
                raise ImproperlyConfigured("OTEL_TRACES_EXPORTER: 'none' cannot be combined "
                                           "with other exporters")
            return ()
    elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        names = ("otlp",)
    else:
        return ()
    if "otlp" in names:
        for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = environ.get(name, "").strip().lower()
            if protocol:
                if protocol not in _PROTOCOLS:
                    raise ImproperlyConfigured(
                        f"{name}={protocol!r}: Tollgate's OTLP exporter speaks "
                        f"{', '.join(_PROTOCOLS)} only")
                break  # the traces-specific variable wins over the general one
    return names


def make_provider(names: tuple[str, ...], service_name: str) -> Any:
    """A TracerProvider exporting to `names` through a BatchSpanProcessor each; its resource
    and sampler from the environment (the SDK reads them)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()
    if not OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        # Neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names it: the SDK would say
        # "unknown_service:python".
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter: Any = OTLPSpanExporter()
        else:
            # sys.stdout as it is now: the exporter's default is the one of its import.
            exporter = ConsoleSpanExporter(out=sys.stdout)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def setup(service_name: str = GATEWAY_SERVICE,
          environ: Mapping[str, str] = os.environ) -> Any:
    """Trace this process if the environment asks for it: returns the TracerProvider (also
    handed to gateway.tracing), or None when tracing is off. Once per process: a second call
    returns the first one's provider."""
    global _provider
    if _provider is not None:
        return _provider
    names = exporters(environ)
    if not names:
        return None
    _provider = make_provider(names, service_name)
    tracing.enable(_provider)
    log.info("tracing on: %s exporter(s), service %s, sampler %s", ", ".join(names),
             _provider.resource.attributes.get("service.name"),
             _provider.sampler.get_description())
    return _provider


def shutdown() -> None:
    """Stop tracing in this process and flush the spans not exported yet (bounded by the
    exporter's timeout). For processes that end without exit hooks."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        tracing.disable()
        provider.shutdown()
