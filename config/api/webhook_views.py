"""Management API: a tenant's webhook endpoints, their signing secret's rotation, test events,
delivery log and redelivery.

Reading is for everyone in the tenant (a member too, who sees each endpoint's URL masked: it can
carry a receiver's token); every change, a rotation, a test send and a redelivery are for owners
and admins (403 for a member). The signing secret is in the creation and rotation responses only
(`Cache-Control: no-store`): no other response carries it. Endpoints and deliveries are
addressed by public id (whk_..., dlv_...) through the tenant, so another tenant's are a 404. A
test send and a redelivery are queued for a worker and answered at once (202, the delivery
pending): the delivery log shows the result. Both are bounded (billing.webhooks): 409 while the
endpoint's test event or the delivery is pending, 429 with Retry-After past the tenant's cap.
Members see the endpoint's host masked in the delivery log too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status as http
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from billing import selectors, tasks, webhooks
from billing.models import WebhookDelivery, WebhookEndpoint
from config.api.billing_serializers import (
    WebhookDeliverySerializer,
    WebhookEndpointCreatedSerializer,
    WebhookEndpointCreateSerializer,
    WebhookEndpointSerializer,
    WebhookEndpointUpdateSerializer,
    WebhookSecretRotatedSerializer,
    WebhookSecretRotateSerializer,
)
from config.api.pagination import BoundedLimitOffsetPagination
from config.api.tenant_scope import TenantScopedAPIView, get_in_tenant, secret_response
from config.celery import app as _celery_app  # noqa: F401 - the web process publishes with it
from tenants.models import Tenant


def _refused(field: str, exc: Exception) -> ValidationError:
    return ValidationError({field: [str(exc)]})


class ManualDeliveryConflict(APIException):
    status_code = http.HTTP_409_CONFLICT
    default_code = "pending"


class TooManyManual(APIException):
    """429; DRF's exception handler turns `wait` into the Retry-After header."""

    status_code = http.HTTP_429_TOO_MANY_REQUESTS
    default_code = "throttled"

    def __init__(self, exc: webhooks.TooManyManualDeliveries) -> None:
        super().__init__(str(exc))
        self.wait = exc.retry_after


def _queue_manual(queue: Callable[[], WebhookDelivery]) -> Response:
    """202 and the queued delivery; 409 when it (or the endpoint's test event) is already
    pending, 429 with Retry-After past the tenant's cap (nothing queued either way)."""
    try:
        delivery = queue()
    except webhooks.ManualDeliveryPending as exc:
        raise ManualDeliveryConflict(str(exc)) from None
    except webhooks.TooManyManualDeliveries as exc:
        raise TooManyManual(exc) from None
    # Only those who may manage the endpoint get here: they see its host whole.
    return Response(WebhookDeliverySerializer(delivery, context={"show_url": True}).data,
                    status=http.HTTP_202_ACCEPTED)


_MANUAL_RESPONSES = {
    202: WebhookDeliverySerializer,
    409: OpenApiResponse(description="Already pending: the endpoint's test event, or this "
                         "delivery, has not finished yet; nothing was queued."),
    429: OpenApiResponse(description="The tenant has TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX test "
                         "events and redeliveries pending; nothing was queued. Retry-After "
                         "says when to try again."),
}


class _EndpointView(TenantScopedAPIView):
    def url_context(self, tenant: Tenant) -> dict[str, bool]:
        """Serializer context: whether the caller sees endpoint URLs in full (those who may
        change the endpoint: owners, admins, operators, tenant tokens; not members)."""
        return {"show_url": webhooks.sees_full_urls(self.principal, tenant)}

    def endpoints(self, tenant: Tenant) -> QuerySet[WebhookEndpoint]:
        return selectors.webhook_endpoints(tenant)

    def endpoint(self, *, manage: bool = False) -> WebhookEndpoint:
        return get_in_tenant(self.endpoints(self.tenant(manage=manage)), "webhook endpoint",
                             public_id=self.kwargs["webhook_id"])


class WebhookListView(_EndpointView):
    """GET /api/tenants/<tenant_id>/webhooks/ (paginated) and POST (create; the response holds
    the signing secret, once)."""

    pagination_class = BoundedLimitOffsetPagination

    @extend_schema(responses=WebhookEndpointSerializer(many=True))
    def get(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant()
        rows = self.endpoints(tenant)
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(rows, request, view=self)
        return paginator.get_paginated_response(WebhookEndpointSerializer(
            page, many=True, context=self.url_context(tenant)).data)

    @extend_schema(request=WebhookEndpointCreateSerializer,
                   responses={201: WebhookEndpointCreatedSerializer,
                              400: OpenApiResponse(description="Field messages.")})
    def post(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant(manage=True)
        data = WebhookEndpointCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            endpoint, secret = webhooks.create_endpoint(
                tenant, data.validated_data["url"], data.validated_data["events"],
                actor=self.actor)
        except webhooks.WebhookUrlRefused as exc:
            raise _refused("url", exc) from None
        except ValueError as exc:
            raise _refused("events", exc) from None
        body = WebhookEndpointSerializer(endpoint, context={"show_url": True}).data
        return secret_response({**body, "secret": secret}, status=http.HTTP_201_CREATED)


class WebhookDetailView(_EndpointView):
    """GET / PATCH (url, events, enabled) / DELETE /api/tenants/<tenant_id>/webhooks/<id>/."""

    @extend_schema(responses=WebhookEndpointSerializer)
    def get(self, request: Request, tenant_id: str, webhook_id: str) -> Response:
        endpoint = self.endpoint()
        return Response(WebhookEndpointSerializer(
            endpoint, context=self.url_context(endpoint.tenant)).data)

    @extend_schema(request=WebhookEndpointUpdateSerializer,
                   responses={200: WebhookEndpointSerializer,
                              400: OpenApiResponse(description="Field messages.")})
    def patch(self, request: Request, tenant_id: str, webhook_id: str) -> Response:
        endpoint = self.endpoint(manage=True)
        data = WebhookEndpointUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            endpoint = webhooks.update_endpoint(endpoint, actor=self.actor, **data.validated_data)
        except webhooks.WebhookUrlRefused as exc:
            raise _refused("url", exc) from None
        except ValueError as exc:
            raise _refused("events", exc) from None
        return Response(WebhookEndpointSerializer(endpoint, context={"show_url": True}).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, tenant_id: str, webhook_id: str) -> Response:
        webhooks.delete_endpoint(self.endpoint(manage=True), actor=self.actor)
        return Response(status=http.HTTP_204_NO_CONTENT)


class WebhookRotateSecretView(_EndpointView):
    """POST /api/tenants/<tenant_id>/webhooks/<id>/rotate-secret {"grace_seconds": 0..604800}:
    a new signing secret, in this response only; the replaced one keeps signing beside it for
    the grace period (billing.webhooks.rotate_secret), unless it cannot sign: then
    `previous_secret_unusable` says why and `previous_secret_valid_until` is null."""

    @extend_schema(request=WebhookSecretRotateSerializer,
                   responses={200: WebhookSecretRotatedSerializer,
                              400: OpenApiResponse(description="Field messages.")})
    def post(self, request: Request, tenant_id: str, webhook_id: str) -> Response:
        endpoint = self.endpoint(manage=True)
        data = WebhookSecretRotateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        endpoint, secret, unusable = webhooks.rotate_secret(
            endpoint, actor=self.actor, grace_seconds=data.validated_data["grace_seconds"])
        body = WebhookEndpointSerializer(endpoint, context={"show_url": True}).data
        return secret_response({**body, "secret": secret,
                                "previous_secret_unusable": unusable or None})


class WebhookTestView(_EndpointView):
    """POST /api/tenants/<tenant_id>/webhooks/<id>/test: queue a `test` event for a worker; the
    answer (202) is the delivery, pending. Its result shows in the delivery log."""

    @extend_schema(request=None, responses=_MANUAL_RESPONSES)
    def post(self, request: Request, tenant_id: str, webhook_id: str) -> Response:
        endpoint = self.endpoint(manage=True)
        return _queue_manual(lambda: tasks.queue_test_event(endpoint, actor=self.actor))


class DeliveryListView(_EndpointView):
    """GET /api/tenants/<tenant_id>/webhooks/<id>/deliveries/: newest first, paginated."""

    pagination_class = BoundedLimitOffsetPagination

    @extend_schema(responses=WebhookDeliverySerializer(many=True))
    def get(self, request: Request, tenant_id: str, webhook_id: str) -> Response:
        endpoint = self.endpoint()
        rows: Any = selectors.webhook_deliveries(endpoint)
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(rows, request, view=self)
        return paginator.get_paginated_response(WebhookDeliverySerializer(
            page, many=True, context=self.url_context(endpoint.tenant)).data)


class RedeliverView(_EndpointView):
    """POST /api/tenants/<tenant_id>/webhooks/<id>/deliveries/<delivery_id>/redeliver: one new
    attempt (same event id), queued for a worker; the answer (202) is the delivery, pending."""

    @extend_schema(request=None, responses=_MANUAL_RESPONSES)
    def post(self, request: Request, tenant_id: str, webhook_id: str,
             delivery_id: str) -> Response:
        endpoint = self.endpoint(manage=True)
        delivery = get_in_tenant(selectors.webhook_deliveries(endpoint), "delivery",
                                 public_id=delivery_id)
        return _queue_manual(lambda: tasks.queue_redelivery(delivery, actor=self.actor))
