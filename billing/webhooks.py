"""Tenant webhooks: endpoints, signed deliveries, retries with backoff, and the SSRF guard.

Payload (JSON, UTF-8), one object per event:

    {"id": "evt_...", "type": "quota.threshold" | "quota.exhausted" | "test",
     "created": <unix seconds>, "tenant": "<slug>", "scope": "tenant" | "project:<slug>",
     "window": "d2026-11-30" | "m2026-11", "limit": int, "used": int, "pending": int,
     "remaining": int, "threshold": <percent remaining; 0 for quota.exhausted>}

`quota.forecast` (billing/forecast_alerts.py: a scope's forecast reached the tenant's
forecast_threshold_percent of its limit; once per scope per window) carries instead:

    {"id", "type": "quota.forecast", "created", "tenant",
     "scope": "tenant" | "project:<slug>" | "key:<name>", "scope_kind": "tenant" | "project" |
     "key", "scope_id": "<public id>", "window_kind": "day" | "cycle",
     "window": "<window id>", "window_start": "<ISO 8601 UTC>", "window_end": "<ISO 8601 UTC>",
     "used": int, "pending": int, "limit": int, "credit": int,
     "forecast": <tokens forecast at the window's end, used and held included>,
     "percent": <forecast as a percentage of limit + credit, one decimal>,
     "would_reach_limit_at": "<ISO 8601 UTC>" | null, "threshold": <the tenant's percent>,
     "method": "trailing_rate" | "daily_shape", "inputs": {<the method's figures>}}

`id` is the event's: the same on every retry and redelivery (receivers dedupe on it).

Signatures follow Standard Webhooks (https://www.standardwebhooks.com), so receivers verify with
the `standardwebhooks` library of their language, given the endpoint's secret:
`webhook-id: <the event's id>` (the same on every retry and redelivery of the event, and the
same to every endpoint it goes to), `webhook-timestamp: <unix seconds of this attempt>` and
`webhook-signature: v1,<base64 HMAC-SHA256(key, f"{webhook-id}.{timestamp}.{raw body}")>`, one
`v1,...` per secret in force, space-separated (two during a rotation's grace period:
rotate_secret). The key is the bytes the secret's base64 after `whsec_` encodes (signing_key).
Secrets are `whsec_` + standard base64 of 32 random bytes; an endpoint made before Standard
Webhooks has `whsec_` + URL-safe base64 without padding of its 32 bytes, the same key written in
the other alphabet (standard_secret gives its standard form; it is never shown again).

Deprecated, sent alongside until release LEGACY_HEADERS_REMOVED_IN:
`Tollgate-Timestamp` (the same timestamp) and
`Tollgate-Signature: v1=<hex HMAC-SHA256(secret, f"{timestamp}.{raw body}")>` (the HMAC key is
the secret's text, `whsec_` included; one comma-separated `v1=` per secret in force); receivers
check them with `verify_signature` (or its five lines, in any language).
`Tollgate-Event: <type>` and `Tollgate-Delivery: dlv_...` (the delivery's public id, as the API
and the console's delivery log show it) say what it is; they stay.

Delivery: one attempt at a time is claimed with a conditional UPDATE (two workers never send the
same attempt); a failed attempt is retried after TOLLGATE_WEBHOOK_BACKOFF_SECONDS (10 s, 30 s,
2 min, 10 min, 1 h) up to TOLLGATE_WEBHOOK_MAX_ATTEMPTS (6), then the delivery is `failed`.
Every attempt has a total deadline (TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS, 10 s: wall clock over
DNS, connect, TLS, sending and every read), so a receiver that answers slowly on purpose (`100
Continue` every second, a response head trickled a byte at a time) cannot hold a worker: each
socket operation gets what is left of the deadline, never more.
This module never talks to the broker: the Celery tasks (billing/tasks.py) dispatch. A person's
test event or redelivery is queued (request_test_event, request_redelivery) and sent by a worker,
never inside the web request.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import httpcore
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from standardwebhooks import Webhook

from billing.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from gateway.crypto import SecretDecryptionError, decrypt_secret, encrypt_secret, reencrypt
from tenants.access import Principal
from tenants.ids import random_base62
from tenants.models import Tenant
from tenants.services import record_audit_event

log = logging.getLogger(__name__)

# Standard Webhooks' headers (lower case, as the specification writes them).
ID_HEADER = "webhook-id"
STANDARD_TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
# The headers from before Standard Webhooks: deprecated, still sent in this release, removed in
# LEGACY_HEADERS_REMOVED_IN (the README's webhook section says the same).
SIGNATURE_HEADER = "Tollgate-Signature"
TIMESTAMP_HEADER = "Tollgate-Timestamp"
LEGACY_HEADERS_REMOVED_IN = "0.3.0"
SIGNATURE_VERSION = "v1"
SECRET_PREFIX = "whsec_"
# Random bytes in a new secret (the specification asks for 24 to 64).
SECRET_BYTES = 32
# The longest a replaced secret may keep signing after a rotation; the API's bound on an API
# key's rotation grace too (config/api/tenancy_serializers.py imports it).
MAX_GRACE_SECONDS = 7 * 24 * 3600
# How long a claimed attempt is reserved for the worker sending it. Longer than any attempt can
# take (the total deadline, at most 60 s: config/settings.py); after it, a worker that died
# mid-attempt is retried by the beat.
CLAIM_SECONDS = 120
_DEFAULT_BACKOFF = (10, 30, 120, 600, 3600)
_USER_AGENT = "Tollgate-Webhooks/1"


class WebhookUrlRefused(ValueError):
    """The URL is malformed or its host resolves to an address webhooks may not reach (SSRF)."""


class ManualDeliveryRefused(Exception):
    """A person's test event or redelivery that would queue more than its bounds allow (the
    `webhooks` queue is shared by every tenant). Nothing was created or changed."""


class ManualDeliveryPending(ManualDeliveryRefused):
    """The endpoint's test event, or this delivery, is already pending (API: 409)."""


class TooManyManualDeliveries(ManualDeliveryRefused):
    """The tenant has TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX manual deliveries pending (API: 429);
    `retry_after` is a whole number of seconds after which one has likely finished."""

    def __init__(self, limit: int, retry_after: int) -> None:
        super().__init__(f"this tenant already has {limit} test events or redeliveries pending "
                         "(TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX); try again when one has finished")
        self.retry_after = retry_after


class WebhookDeadlineExceeded(Exception):
    """An attempt ran out of its total deadline (whatever phase it was in)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no complete answer within the total deadline of {seconds:g} s "
                         "(TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS)")


# -- settings -----------------------------------------------------------------------------------


def allow_private() -> bool:
    return bool(getattr(settings, "TOLLGATE_WEBHOOK_ALLOW_PRIVATE", False))


def _timeout_s() -> float:
    """The limit of each socket operation (connect, one write, one read)."""
    return float(getattr(settings, "TOLLGATE_WEBHOOK_TIMEOUT_SECONDS", 5.0))


def total_timeout_s() -> float:
    """The wall-clock limit of a whole attempt, DNS included (see Deadline)."""
    return float(getattr(settings, "TOLLGATE_WEBHOOK_TOTAL_TIMEOUT_SECONDS", 10.0))


def _max_attempts() -> int:
    return int(getattr(settings, "TOLLGATE_WEBHOOK_MAX_ATTEMPTS", 6))


def manual_pending_max() -> int:
    """How many test events and redeliveries one tenant may have pending at once."""
    return int(getattr(settings, "TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX", 5))


def backoff_s(attempt: int) -> float:
    """The wait after failed attempt number `attempt` (1-based); the last value repeats."""
    delays: Sequence[float] = getattr(settings, "TOLLGATE_WEBHOOK_BACKOFF_SECONDS",
                                      _DEFAULT_BACKOFF)
    return float(delays[min(attempt, len(delays)) - 1]) if delays else 0.0


# -- the total deadline -------------------------------------------------------------------------


class Deadline:
    """The wall-clock end of one attempt. Every blocking step asks it for its timeout: the
    step's own limit, cut to what is left, so the sum of all steps never passes the end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def clamp(self, timeout: float | None) -> float:
        """The timeout for the next step; WebhookDeadlineExceeded once nothing is left."""
        left = self.remaining()
        if left <= 0:
            raise WebhookDeadlineExceeded(self.seconds)
        return left if timeout is None else min(timeout, left)


# getaddrinfo has no timeout of its own (the system resolver's retries can take half a
# minute, and a tenant controls its domain's name servers), so lookups run on a few threads and
# the caller waits at most until its deadline. A lookup left behind ends by itself; with every
# thread busy, new lookups queue and fail at their deadline. One pool per process (Celery forks).
_RESOLVER_THREADS = 4
_resolver: tuple[int, ThreadPoolExecutor] | None = None
_resolver_lock = threading.Lock()


def _resolver_pool() -> ThreadPoolExecutor:
    global _resolver
    with _resolver_lock:
        if _resolver is None or _resolver[0] != os.getpid():
            _resolver = (os.getpid(), ThreadPoolExecutor(_RESOLVER_THREADS,
                                                         thread_name_prefix="webhook-dns"))
        return _resolver[1]


def _getaddrinfo(host: str, port: int, deadline: Deadline) -> list[str]:
    """The addresses of `host`, in the resolver's order, within the deadline."""
    future: Future[Any] = _resolver_pool().submit(socket.getaddrinfo, host, port,
                                                  type=socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=deadline.clamp(None))
    except FutureTimeout:
        future.cancel()
        raise WebhookUrlRefused(f"the webhook URL's host {host!r} did not resolve within "
                                f"{deadline.seconds:g} s") from None
    except WebhookDeadlineExceeded:
        future.cancel()
        raise
    except (socket.gaierror, UnicodeError):
        # Said the same way as a private answer: the refusal must not tell a tenant which
        # internal names exist.
        raise WebhookUrlRefused(_NOT_PUBLIC.format(host=host)) from None
    return list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


# -- SSRF guard ---------------------------------------------------------------------------------

# The whole refusal: never the addresses the host resolved to (internal DNS answers are not the
# tenant's business), and the same words whether the name is internal or does not exist.
_NOT_PUBLIC = ("the webhook URL's host {host!r} is not a public address "
               "(webhooks only go to public internet addresses)")

# IPv6 ranges that carry an IPv4 address inside them. A relay or translator on the way forwards
# to that IPv4 address, which may be an internal one, and no webhook receiver needs them: all
# refused, whatever they embed. (IPv4-mapped addresses, ::ffff:a.b.c.d, are judged as the IPv4
# address they are: a dual-stack socket connects to exactly that.)
EMBEDDED_IPV4_NETWORKS = tuple(ipaddress.IPv6Network(n) for n in (
    "2002::/16",         # 6to4
    "2001::/32",         # Teredo
    "64:ff9b::/96",      # NAT64, well-known prefix
    "64:ff9b:1::/48",    # NAT64, local use
    "::/96",             # IPv4-compatible (deprecated)
    "::ffff:0:0:0/96",   # IPv4-translated (SIIT)
))


def _forbidden(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif any(ip in network for network in EMBEDDED_IPV4_NETWORKS):
            return True
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
            or ip.is_reserved or ip.is_unspecified or not ip.is_global)


def _split(url: str) -> tuple[Any, str, int]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookUrlRefused(f"invalid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookUrlRefused("webhook URLs must use http or https")
    if not parts.hostname:
        raise WebhookUrlRefused("webhook URL has no host")
    if parts.username is not None or parts.password is not None:
        raise WebhookUrlRefused("credentials in webhook URLs are not supported")
    return parts, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def resolve_allowed(host: str, port: int, deadline: Deadline | None = None) -> list[str]:
    """Every address `host` resolves to (within the deadline: by default the total one), or
    WebhookUrlRefused when one of them is private, loopback, link-local, multicast, reserved or
    an IPv4-embedding transition address (unless TOLLGATE_WEBHOOK_ALLOW_PRIVATE)."""
    addresses = _getaddrinfo(host, port, deadline or Deadline(total_timeout_s()))
    if not addresses:
        raise WebhookUrlRefused(_NOT_PUBLIC.format(host=host))
    if not allow_private():
        refused = [a for a in addresses if _forbidden(ipaddress.ip_address(a))]
        if refused:
            # The operator's log may name the address; the tenant's message does not.
            log.info("webhook host %r refused: it resolves to %s", host, ", ".join(refused))
            raise WebhookUrlRefused(_NOT_PUBLIC.format(host=host))
    return addresses


def check_url(url: str) -> None:
    """Refuse a URL webhooks may not call (see resolve_allowed); resolves its host now."""
    if len(url) > 2000:
        raise WebhookUrlRefused("webhook URL is longer than 2000 characters")
    _parts, host, port = _split(url)
    resolve_allowed(host, port)


def pinned_request(url: str, deadline: Deadline | None = None,
                   ) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The URL to connect to, with extra headers and httpcore extensions.

    The host is resolved and checked here, and the connection goes to that checked address (the
    Host header and TLS server name keep the original name, so virtual hosts and certificate
    checks are unchanged): a DNS answer that changes between check and connect (DNS rebinding)
    cannot send the request elsewhere.
    """
    parts, host, port = _split(url)
    addresses = resolve_allowed(host, port, deadline)
    if allow_private():
        return url, {}, {}
    address = addresses[0]
    netloc = f"[{address}]" if ":" in address else address
    if parts.port is not None:
        netloc += f":{parts.port}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    return pinned, {"Host": parts.netloc}, extensions


# -- the HTTP client under the deadline ---------------------------------------------------------


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose every operation gets at most what is left of the deadline. A
    timeout that the deadline cut short is reported as the deadline, not as a slow read."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: Deadline) -> None:
        self._stream = stream
        self._deadline = deadline

    def _timed(self, step: Any, timeout: float | None) -> Any:
        limit = self._deadline.clamp(timeout)
        try:
            return step(limit)
        except httpcore.TimeoutException:
            if timeout is None or limit < timeout:
                raise WebhookDeadlineExceeded(self._deadline.seconds) from None
            raise

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._timed(lambda t: self._stream.read(max_bytes, t), timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._timed(lambda t: self._stream.write(buffer, t), timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        tls = self._timed(lambda t: self._stream.start_tls(ssl_context, server_hostname, t),
                          timeout)
        return _DeadlineStream(tls, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's socket backend with the deadline on every step, name resolution included
    (a pinned URL names an address, which resolves at once; with private targets allowed the
    name is resolved here, under the deadline, and each address tried in turn)."""

    def __init__(self, deadline: Deadline) -> None:
        self._backend = httpcore.SyncBackend()
        self._deadline = deadline

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        failure: Exception = httpcore.ConnectError(f"{host!r} resolves to no address")
        for address in _getaddrinfo(host, port, self._deadline):
            limit = self._deadline.clamp(timeout)
            try:
                stream = self._backend.connect_tcp(address, port, limit, local_address,
                                                   socket_options)
            except httpcore.ConnectTimeout:
                if timeout is None or limit < timeout:
                    raise WebhookDeadlineExceeded(self._deadline.seconds) from None
                raise
            except httpcore.ConnectError as exc:
                failure = exc
                continue
            return _DeadlineStream(stream, self._deadline)
        raise failure

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, max(self._deadline.remaining(), 0.0)))


def post_within(url: str, body: bytes, headers: dict[str, str], extensions: dict[str, Any],
                deadline: Deadline) -> int:
    """POST `body` and return the response's status code, all within `deadline`. No proxies
    (they would bypass the address check), no redirects (a 3xx is a failure), and the response
    body is never read: the status line and headers are the answer."""
    timeout = _timeout_s()
    timeouts = {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}
    with httpcore.ConnectionPool(network_backend=_DeadlineBackend(deadline),
                                 max_connections=1) as pool:
        with pool.stream("POST", url, headers=list(headers.items()), content=body,
                         extensions={**extensions, "timeout": timeouts}) as response:
            return response.status


# -- signatures ---------------------------------------------------------------------------------


def _bytes(body: bytes | str) -> bytes:
    return body.encode() if isinstance(body, str) else body


def sign(secret: str, timestamp: int | str, body: bytes | str) -> str:
    """The Tollgate-Signature header value: `v1=<hex HMAC-SHA256 of "{timestamp}.{body}">`."""
    message = f"{timestamp}.".encode() + _bytes(body)
    digest = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return f"{SIGNATURE_VERSION}={digest}"


def verify_signature(secret: str, timestamp: str | int, body: bytes | str, header: str,
                     tolerance_s: int = 300, *, now: float | None = None) -> bool:
    """For receivers: True when `header` (Tollgate-Signature) signs `body` (the raw request
    body, before any JSON parsing) at `timestamp` (Tollgate-Timestamp) with `secret`, and the
    timestamp is within `tolerance_s` of now (replay protection). The header may carry several
    comma-separated `v1=` values; one match is enough."""
    try:
        ts = int(str(timestamp).strip())
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    expected = sign(secret, ts, body)
    return any(hmac.compare_digest(expected, candidate.strip())
               for candidate in (header or "").split(","))


def signing_key(secret: str) -> bytes:
    """The HMAC key of the Standard Webhooks signature: the bytes that the secret's base64 after
    `whsec_` encodes. Both alphabets are read, padding or not: new secrets are standard base64
    (what every standardwebhooks library decodes), secrets made before are URL-safe base64
    without padding (secrets.token_urlsafe), and the two alphabets differ only in `+/` / `-_`,
    so an old secret keeps its 32 random bytes as its key. ValueError for anything else."""
    body = secret.removeprefix(SECRET_PREFIX).rstrip("=").replace("+", "-").replace("/", "_")
    try:
        key = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a webhook secret is whsec_ followed by base64") from None
    if not key:
        raise ValueError("a webhook secret is whsec_ followed by base64")
    return key


def standard_secret(secret: str) -> str:
    """The secret as Standard Webhooks libraries take it: `whsec_` + standard base64 (padded) of
    signing_key. A new secret is already that; a secret from before Standard Webhooks (URL-safe,
    unpadded) becomes the same text with `-` -> `+`, `_` -> `/` and `=` appended: what its
    holder does (the README's webhook section), since Tollgate never shows a secret again."""
    return SECRET_PREFIX + base64.b64encode(signing_key(secret)).decode("ascii")


def signature_headers(secrets_in_force: Sequence[str], message_id: str, timestamp: int,
                      body: bytes) -> dict[str, str]:
    """The signature headers of one attempt: Standard Webhooks' three, with one `v1,<base64>`
    per secret in force (space-separated), and the deprecated Tollgate-Timestamp /
    Tollgate-Signature with one `v1=<hex>` per secret (comma-separated). The standardwebhooks
    package signs, so what it verifies is what is sent by construction; it reads the body as
    text, and encode() makes ASCII JSON."""
    text = body.decode("utf-8")
    sent_at = datetime.fromtimestamp(timestamp, UTC)
    return {
        ID_HEADER: message_id,
        STANDARD_TIMESTAMP_HEADER: str(timestamp),
        STANDARD_SIGNATURE_HEADER: " ".join(
            Webhook(signing_key(secret)).sign(message_id, sent_at, text)
            for secret in secrets_in_force),
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: ",".join(sign(secret, timestamp, body) for secret in secrets_in_force),
    }


# -- endpoints ----------------------------------------------------------------------------------


def _check_events(events: Iterable[str]) -> list[str]:
    events = list(dict.fromkeys(events))
    unknown = sorted(set(events) - set(WebhookEvent.values))
    if unknown:
        raise ValueError(f"unknown webhook event(s): {', '.join(unknown)}; "
                         f"known: {', '.join(WebhookEvent.values)}")
    return events


def new_secret() -> str:
    """`whsec_` + standard base64 of SECRET_BYTES random bytes (the Standard Webhooks format)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def create_endpoint(tenant: Tenant, url: str, events: Iterable[str], *,
                    actor: str) -> tuple[WebhookEndpoint, str]:
    """A new endpoint and its signing secret, whose plaintext is returned once and stored only
    encrypted. Raises WebhookUrlRefused (a ValueError) for a URL webhooks may not call."""
    events = _check_events(events)
    check_url(url)
    secret = new_secret()
    with transaction.atomic():
        endpoint = WebhookEndpoint.objects.create(
            tenant=tenant, url=url, secret_encrypted=encrypt_secret(secret), events=events)
        # The audit log is readable by members: it names the endpoint's masked URL only.
        record_audit_event(tenant=tenant, actor=actor, action="webhook.created",
                           target=endpoint.public_id,
                           data={"url": masked_url(url), "events": events})
    return endpoint, secret


def update_endpoint(endpoint: WebhookEndpoint, *, actor: str, url: str | None = None,
                    events: Iterable[str] | None = None,
                    enabled: bool | None = None) -> WebhookEndpoint:
    """Change an endpoint's URL, events or enabled flag (None: unchanged); the secret stays.
    Raises WebhookUrlRefused / ValueError before writing anything."""
    changes: dict[str, Any] = {}
    if url is not None and url != endpoint.url:
        check_url(url)
        changes["url"] = url
    if events is not None:
        checked = _check_events(events)
        if checked != list(endpoint.events or []):
            changes["events"] = checked
    if enabled is not None and enabled != endpoint.enabled:
        changes["enabled"] = bool(enabled)
    if not changes:
        return endpoint
    with transaction.atomic():
        WebhookEndpoint.objects.filter(pk=endpoint.pk).update(**changes)
        audited = {**changes, "url": masked_url(changes["url"])} if "url" in changes else changes
        record_audit_event(tenant=endpoint.tenant, actor=actor, action="webhook.updated",
                           target=endpoint.public_id, data=audited)
    endpoint.refresh_from_db()
    return endpoint


class SecretRotation(NamedTuple):
    """What rotate_secret did: the endpoint as left, its new secret (the plaintext, shown once),
    and why the replaced secret was not kept for the grace period asked for ("" when it was, or
    when no grace was asked)."""

    endpoint: WebhookEndpoint
    secret: str
    previous_unusable: str


def _usable(ciphertext: str) -> tuple[str, str]:
    """(the stored secret, "") when it can sign, ("", why not) otherwise: the same two checks an
    attempt makes (decryption with TOLLGATE_ENCRYPTION_KEYS, then signing_key), so what passes
    here signs."""
    try:
        secret = decrypt_secret(ciphertext)
        signing_key(secret)
    except SecretDecryptionError:
        return "", "it cannot be decrypted (TOLLGATE_ENCRYPTION_KEYS)"
    except ValueError as exc:
        return "", f"it cannot sign: {exc}"
    return secret, ""


def rotate_secret(endpoint: WebhookEndpoint, *, actor: str,
                  grace_seconds: int = 0) -> SecretRotation:
    """Give the endpoint a new secret (returned once, stored encrypted); the one it replaces
    stops signing now, or keeps signing beside it for `grace_seconds` (at most
    MAX_GRACE_SECONDS) so the receiver can switch without refusing a delivery. A secret replaced
    by an earlier rotation stops now: at most two secrets sign at once. ValueError for a grace
    out of range, nothing changed.

    A replaced secret that cannot sign (no configured key decrypts it, or it is not whsec_ +
    base64: the reason a tenant rotates a broken secret) is not kept, whatever the grace: it
    would sign nothing, and deliveries need the new secret at once. The result's
    previous_unusable and the audit event say so. The replaced secret's ciphertext is moved as
    it is, and the audit event names the grace period, never a secret."""
    if not 0 <= grace_seconds <= MAX_GRACE_SECONDS:
        raise ValueError(f"grace_seconds must be between 0 and {MAX_GRACE_SECONDS} (7 days)")
    secret = new_secret()
    unusable = ""
    with transaction.atomic():
        locked = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
        now = timezone.now()
        if grace_seconds:
            # Checked under the lock: the ciphertext checked is the one moved.
            unusable = _usable(locked.secret_encrypted)[1]
        keep = bool(grace_seconds) and not unusable
        valid_until = now + timedelta(seconds=grace_seconds) if keep else None
        WebhookEndpoint.objects.filter(pk=locked.pk).update(
            secret_encrypted=encrypt_secret(secret),
            previous_secret_encrypted=locked.secret_encrypted if keep else "",
            previous_secret_expires_at=valid_until)
        record_audit_event(tenant=locked.tenant, actor=actor, action="webhook.secret_rotated",
                           target=locked.public_id,
                           data={"grace_seconds": grace_seconds,
                                 "previous_valid_until": valid_until.isoformat()
                                 if valid_until else None,
                                 "previous_unusable": unusable or None})
    if unusable:
        log.warning("webhook endpoint %s: its replaced secret is not kept for the %d s grace "
                    "asked for: %s", locked.public_id, grace_seconds, unusable)
    endpoint.refresh_from_db()
    return SecretRotation(endpoint, secret, unusable)


def secrets_in_force(endpoint: WebhookEndpoint, now: datetime) -> list[str]:
    """The secrets that sign a delivery now: the endpoint's, then the one a rotation replaced
    while its grace period lasts. SecretDecryptionError if the endpoint's own secret cannot be
    decrypted (the attempt fails). A replaced secret that cannot sign (stored before
    rotate_secret checked it, or its key dropped from TOLLGATE_ENCRYPTION_KEYS too early) is
    left out with a warning: failing the attempt for it would refuse the receivers that
    already use the new secret too."""
    in_force = [endpoint.secret]
    if endpoint.previous_secret_valid_until(now) is not None:
        previous, unusable = _usable(endpoint.previous_secret_encrypted)
        if unusable:
            log.warning("webhook endpoint %s: its previous secret (grace until %s) is left out "
                        "of the signatures: %s", endpoint.public_id,
                        endpoint.previous_secret_expires_at, unusable)
        else:
            in_force.append(previous)
    return in_force


def clear_expired_previous_secrets(now: datetime | None = None) -> int:
    """Forget the replaced secrets whose grace period has ended (their ciphertext, kept for
    nothing, would outlive the secret by as long as the endpoint lives); returns how many.
    One conditional UPDATE: a rotation holding an endpoint's row lock is waited for, and
    PostgreSQL re-checks the WHERE after it, so a grace period that rotation just started is
    never cleared. Run every minute by the beat (billing.tasks.retry_due_webhooks)."""
    return (WebhookEndpoint.objects
            .filter(previous_secret_expires_at__lte=now or timezone.now())
            .update(previous_secret_encrypted="", previous_secret_expires_at=None))


def reencrypt_webhook_secrets() -> int:
    """Re-encrypt every endpoint's secret, and the replaced one while its grace period lasts,
    under the first key of TOLLGATE_ENCRYPTION_KEYS; returns how many endpoints were
    re-encrypted. The webhook half of the key rotation step
    (billing.encryption.reencrypt_stored_secrets).

    A replaced secret whose grace has ended, or that no configured key opens (it signs nothing
    already: secrets_in_force leaves it out), is cleared instead: no delivery changes. An
    endpoint's own secret that no configured key opens raises SecretDecryptionError naming the
    endpoint (deliveries to it fail already; dropping the key would make that final), and the
    caller's transaction then rolls back."""
    changed = 0
    now = timezone.now()
    cleared = {"previous_secret_encrypted": "", "previous_secret_expires_at": None}
    with transaction.atomic():
        for endpoint in WebhookEndpoint.objects.select_for_update().order_by("pk"):
            try:
                update: dict[str, Any] = {"secret_encrypted": reencrypt(endpoint.secret_encrypted)}
            except SecretDecryptionError as exc:
                raise SecretDecryptionError(
                    f"webhook endpoint {endpoint.public_id}: no configured key decrypts its "
                    "signing secret (deliveries to it fail); rotate that secret, or put back "
                    "the key that encrypted it") from exc
            if endpoint.previous_secret_valid_until(now) is not None:
                try:
                    update["previous_secret_encrypted"] = reencrypt(
                        endpoint.previous_secret_encrypted)
                except SecretDecryptionError:
                    log.warning("webhook endpoint %s: its previous secret (grace until %s) "
                                "cannot be decrypted and signs nothing; cleared",
                                endpoint.public_id, endpoint.previous_secret_expires_at)
                    update.update(cleared)
            elif endpoint.previous_secret_encrypted or endpoint.previous_secret_expires_at:
                update.update(cleared)
            WebhookEndpoint.objects.filter(pk=endpoint.pk).update(**update)
            changed += 1
    return changed


def delete_endpoint(endpoint: WebhookEndpoint, *, actor: str) -> None:
    """Delete an endpoint and its delivery log."""
    with transaction.atomic():
        record_audit_event(tenant=endpoint.tenant, actor=actor, action="webhook.deleted",
                           target=endpoint.public_id, data={"url": masked_url(endpoint.url)})
        endpoint.delete()


# -- deliveries ---------------------------------------------------------------------------------


def new_event_id() -> str:
    return "evt_" + random_base62(24)


def event_payload(event_type: str, tenant: Tenant, **fields: Any) -> dict[str, Any]:
    return {"id": new_event_id(), "type": str(event_type), "created": int(time.time()),
            "tenant": tenant.slug, **fields}


def create_deliveries(tenant: Tenant, event_type: str,
                      payload: dict[str, Any]) -> list[WebhookDelivery]:
    """One pending delivery, due now, per enabled endpoint of the tenant subscribed to the
    event. Dispatching them is the caller's business (billing.tasks.dispatch_deliveries)."""
    now = timezone.now()
    endpoints = [e for e in WebhookEndpoint.objects.filter(tenant=tenant, enabled=True)
                 if event_type in (e.events or [])]
    return WebhookDelivery.objects.bulk_create([
        WebhookDelivery(endpoint=e, event_type=event_type, payload=payload, next_attempt_at=now)
        for e in endpoints
    ])


def encode(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def _claim(delivery: WebhookDelivery, now: datetime) -> bool:
    """Take the next attempt of a due delivery; False when another worker has it, or it is not
    due, or it has ended. PostgreSQL re-checks the WHERE after a concurrent update, so of two
    workers claiming the same attempt exactly one gets a row."""
    claimed = WebhookDelivery.objects.filter(
        pk=delivery.pk, status=WebhookDelivery.Status.PENDING, attempts=delivery.attempts,
        next_attempt_at__lte=now,
    ).update(attempts=F("attempts") + 1, next_attempt_at=now + timedelta(seconds=CLAIM_SECONDS))
    return claimed == 1


def _send(endpoint: WebhookEndpoint, body: bytes, event_type: str, delivery_id: str,
          message_id: str) -> tuple[int | None, str]:
    """POST one attempt within the total deadline; (status code or None, error text)."""
    deadline = Deadline(total_timeout_s())
    try:
        url, headers, extensions = pinned_request(endpoint.url, deadline)
    except WebhookUrlRefused as exc:
        return None, f"refused: {exc}"
    except WebhookDeadlineExceeded as exc:
        return None, str(exc)
    timestamp = int(time.time())
    try:
        signed = signature_headers(secrets_in_force(endpoint, timezone.now()), message_id,
                                   timestamp, body)
    except SecretDecryptionError:
        return None, "the endpoint's secret cannot be decrypted (TOLLGATE_ENCRYPTION_KEYS)"
    except ValueError as exc:  # a stored secret Tollgate did not make (signing_key)
        return None, f"the endpoint's secret cannot sign: {exc}"
    headers.update({
        "Content-Type": "application/json",
        "User-Agent": _USER_AGENT,
        "Tollgate-Event": event_type,
        "Tollgate-Delivery": delivery_id,  # the public id (dlv_...), as the API shows it
        **signed,
    })
    try:
        return post_within(url, body, headers, extensions, deadline), ""
    except WebhookDeadlineExceeded as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure is a failed attempt, retried later
        return None, f"{type(exc).__name__}: {exc}"[:500]


def _one_attempt_only(delivery: WebhookDelivery) -> bool:
    """A person's test event is not retried: they watch the log and ask again, and a new one
    may be asked for only once this one has finished (request_test_event), which must not
    take the hour of a full retry schedule."""
    return delivery.manual and delivery.event_type == WebhookEvent.TEST


def message_id(delivery: WebhookDelivery) -> str:
    """The delivery's `webhook-id`: its event's id (evt_...), which the payload carries and
    which stays the same on every retry and redelivery, as Standard Webhooks asks; the
    delivery's public id for a payload made without one (create_deliveries takes any dict)."""
    return str((delivery.payload or {}).get("id") or delivery.public_id)


def deliver(delivery_id: int) -> WebhookDelivery | None:
    """One attempt of a delivery if it is pending and due; idempotent. Returns the delivery as
    left (None when it does not exist). Safe when several workers call it at once."""
    delivery = (WebhookDelivery.objects.select_related("endpoint__tenant")
                .filter(pk=delivery_id).first())
    if delivery is None or delivery.status != WebhookDelivery.Status.PENDING:
        return delivery
    now = timezone.now()
    if delivery.next_attempt_at is None or delivery.next_attempt_at > now:
        return delivery
    if not _claim(delivery, now):
        delivery.refresh_from_db()
        return delivery
    attempt = delivery.attempts + 1
    code, error = _send(delivery.endpoint, encode(delivery.payload), delivery.event_type,
                        delivery.public_id, message_id(delivery))
    done = timezone.now()
    ok = code is not None and 200 <= code < 300
    if ok:
        update: dict[str, Any] = {"status": WebhookDelivery.Status.DELIVERED,
                                  "delivered_at": done, "next_attempt_at": None,
                                  "last_status_code": code, "last_error": ""}
    else:
        error = error or f"HTTP {code}"
        update = {"last_status_code": code, "last_error": error}
        if attempt >= _max_attempts() or _one_attempt_only(delivery):
            update.update(status=WebhookDelivery.Status.FAILED, next_attempt_at=None)
            log.warning("webhook delivery %s to %s failed for good after %d attempts: %s",
                        delivery.pk, delivery.endpoint.public_id, attempt, error)
        else:
            update["next_attempt_at"] = done + timedelta(seconds=backoff_s(attempt))
            log.info("webhook delivery %s to %s: attempt %d failed (%s), retry at %s",
                     delivery.pk, delivery.endpoint.public_id, attempt, error,
                     update["next_attempt_at"])
    # Only if the attempt is still ours (a manual redelivery may have started another).
    WebhookDelivery.objects.filter(pk=delivery.pk, attempts=attempt,
                                   status=WebhookDelivery.Status.PENDING).update(**update)
    delivery.refresh_from_db()
    return delivery


def due_delivery_ids(*, limit: int = 500) -> list[int]:
    """Pending deliveries whose next attempt is due (new ones, retries, and attempts whose
    worker died after claiming them)."""
    return list(WebhookDelivery.objects
                .filter(status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=timezone.now())
                .order_by("next_attempt_at").values_list("pk", flat=True)[:limit])


def schedule_redelivery(delivery: WebhookDelivery) -> WebhookDelivery:
    """Make a delivery pending and due now, whatever its state (the next attempt sends the same
    event id with a fresh timestamp and signature). If that attempt fails, automatic retries
    continue while attempts remain; past the maximum the delivery is `failed` again."""
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        status=WebhookDelivery.Status.PENDING, next_attempt_at=timezone.now(), delivered_at=None)
    delivery.refresh_from_db()
    return delivery


def redeliver(delivery: WebhookDelivery) -> WebhookDelivery:
    """Manual redelivery in this process: one new attempt now (see schedule_redelivery). For
    workers and scripts; a person's redelivery is queued (request_redelivery)."""
    schedule_redelivery(delivery)
    return deliver(delivery.pk) or delivery


def create_test_event(endpoint: WebhookEndpoint, *, manual: bool = False) -> WebhookDelivery:
    """A pending `test` delivery to the endpoint, due now (whether or not it subscribes to
    `test`); a worker sends it. A person's (manual) one is not retried."""
    payload = event_payload(WebhookEvent.TEST, endpoint.tenant, scope="tenant", window="",
                            limit=0, used=0, pending=0, remaining=0, threshold=0)
    return WebhookDelivery.objects.create(
        endpoint=endpoint, event_type=WebhookEvent.TEST, payload=payload,
        next_attempt_at=timezone.now(), manual=manual)


def send_test_event(endpoint: WebhookEndpoint) -> WebhookDelivery:
    """A `test` event sent in this process now (for workers and scripts)."""
    delivery = create_test_event(endpoint)
    return deliver(delivery.pk) or delivery


# -- a person's test events and redeliveries: bounded ---------------------------------------------
# Each queued attempt may take a whole total deadline on a worker of the shared `webhooks` queue,
# so what one tenant may queue by hand is bounded: one unfinished test event per endpoint, no
# redelivery of a delivery still pending, and TOLLGATE_WEBHOOK_MANUAL_PENDING_MAX pending manual
# deliveries per tenant. The checks run under a lock on the tenant's row, so two concurrent
# requests cannot both pass them.


def _lock_tenant(tenant: Tenant) -> None:
    # NO KEY UPDATE: serialises these checks without blocking inserts that reference the tenant.
    Tenant.objects.select_for_update(no_key=True).filter(pk=tenant.pk).values_list("pk").get()


def _manual_pending(tenant: Tenant) -> Any:
    return WebhookDelivery.objects.filter(endpoint__tenant=tenant, manual=True,
                                          status=WebhookDelivery.Status.PENDING)


def _check_tenant_cap(tenant: Tenant) -> None:
    limit = manual_pending_max()
    pending = _manual_pending(tenant)
    if pending.count() < limit:
        return
    soonest = pending.order_by("next_attempt_at").values_list("next_attempt_at", flat=True)[0]
    wait = (soonest - timezone.now()).total_seconds() if soonest is not None else 0.0
    raise TooManyManualDeliveries(limit, max(1, int(max(wait, 0.0) + total_timeout_s()) + 1))


def request_test_event(endpoint: WebhookEndpoint, *, actor: str) -> WebhookDelivery:
    """A person's "send test event": audited, and a pending delivery for a worker to send. The
    caller queues it (billing.tasks.queue_test_event): no web request waits on a receiver.
    ManualDeliveryPending while the endpoint's last test event is pending,
    TooManyManualDeliveries past the tenant's cap; either way nothing is written."""
    with transaction.atomic():
        _lock_tenant(endpoint.tenant)
        if _manual_pending(endpoint.tenant).filter(endpoint=endpoint,
                                                   event_type=WebhookEvent.TEST).exists():
            raise ManualDeliveryPending("a test event to this endpoint is already pending: its "
                                        "result shows in the delivery log")
        _check_tenant_cap(endpoint.tenant)
        record_audit_event(tenant=endpoint.tenant, actor=actor, action="webhook.test_sent",
                           target=endpoint.public_id)
        return create_test_event(endpoint, manual=True)


def request_redelivery(delivery: WebhookDelivery, *, actor: str) -> WebhookDelivery:
    """A person's "redeliver": audited, and the delivery due now for a worker to send (the
    caller queues it: billing.tasks.queue_redelivery). ManualDeliveryPending while the delivery
    is pending (queued or waiting for a retry), TooManyManualDeliveries past the tenant's cap;
    either way nothing is written."""
    tenant = delivery.endpoint.tenant
    with transaction.atomic():
        _lock_tenant(tenant)
        if WebhookDelivery.objects.filter(pk=delivery.pk,
                                          status=WebhookDelivery.Status.PENDING).exists():
            raise ManualDeliveryPending(f"delivery {delivery.public_id} is already pending: its "
                                        "next attempt is queued or scheduled")
        _check_tenant_cap(tenant)
        record_audit_event(tenant=tenant, actor=actor, action="webhook.redelivered",
                           target=delivery.public_id,
                           data={"endpoint": delivery.endpoint.public_id,
                                 "event_type": delivery.event_type})
        WebhookDelivery.objects.filter(pk=delivery.pk).update(manual=True)
        return schedule_redelivery(delivery)


# -- what members see ---------------------------------------------------------------------------


def sees_full_urls(principal: Principal, tenant: Tenant) -> bool:
    """Whether this viewer sees the tenant's endpoint URLs (and the host names in its delivery
    log) whole: those who may change the endpoints (owners, admins, operators, tenant tokens).
    Members see them masked (masked_url, masked_error): a URL can carry a receiver's token."""
    return principal.can_manage(tenant)


def _masked_host(host: str) -> str:
    """The last two labels of a host name; nothing of an address literal."""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        labels = host.split(".")
        return ".".join(labels[-2:]) if len(labels) > 2 else host


def masked_url(url: str) -> str:
    """An endpoint's URL as a member (read-only role) sees it: the scheme and the last two labels
    of the host name, nothing of the path, query or port (receivers often carry a token there:
    https://hooks.example.com/T0/B0/secret -> "https://…example.com/…"). An address literal
    shows no host at all."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "…"
    shown = _masked_host(host)
    return f"{parts.scheme}://…{shown}/…" if shown else f"{parts.scheme}://…/…"


def shown_url(url: str, full: bool) -> str:
    """The URL as this viewer sees it (full: sees_full_urls)."""
    return url if full else masked_url(url)


def masked_error(error: str, url: str) -> str:
    """A delivery's last error as a member sees it: the endpoint's host name (a refusal names
    it) cut as masked_url cuts it, e.g. 'x.y.example.com' -> '…example.com'."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return error
    if not host:
        return error
    shown = _masked_host(host)
    if shown == host:  # a two-label name: masked_url shows it whole too
        return error
    return error.replace(host, f"…{shown}" if shown else "…")


def shown_error(delivery: WebhookDelivery, full: bool) -> str:
    """The delivery's last error as this viewer sees it (full: sees_full_urls)."""
    return delivery.last_error if full else masked_error(delivery.last_error,
                                                         delivery.endpoint.url)
