import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from config import telemetry  # noqa: E402 - after Django's setup: its line in the log format

# Here, in no module uvicorn's supervisor imports: each worker process imports this one, so each
# gets its own exporter thread (OTEL_* variables: off without them).
_tracing = telemetry.setup() is not None

from gateway.asgi import GatewayRouter  # noqa: E402 - needs the apps loaded above
from gateway.urls import direct_routes, prefix_routes  # noqa: E402

# /v1 and the health checks skip Django's middleware and signals (see gateway/asgi.py). At the
# worker's lifespan shutdown the router writes the metrics' tally, then flushes the spans not
# exported yet when tracing (config/telemetry.py).
application = GatewayRouter(django_application, direct_routes(), prefix_routes(),
                            on_shutdown=(telemetry.shutdown,) if _tracing else ())
