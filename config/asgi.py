import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_application = get_asgi_application()

from gateway.asgi import GatewayRouter  # noqa: E402 - needs the apps loaded above
from gateway.urls import direct_routes, prefix_routes  # noqa: E402

# /v1 and the health checks skip Django's middleware and signals (see gateway/asgi.py).
application = GatewayRouter(django_application, direct_routes(), prefix_routes())
