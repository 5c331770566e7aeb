"""Bearer management tokens for the /api/ endpoints (`Authorization: Bearer tgm_...`)."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Q
from django.utils import timezone
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from tenants.api_key_format import digests_match
from tenants.management_tokens import TOKEN_SCHEME, parse_token
from tenants.models import ManagementToken

# last_used_at is for humans ("used 3 minutes ago"); one write a minute per token is plenty.
_TOUCH_EVERY = timedelta(minutes=1)


class TokenUser:
    """What `request.user` is for a token-authenticated request: authenticated, no session,
    not a Django user. Permissions go through tenants.access.Principal, which reads the token."""

    is_authenticated = True
    is_anonymous = False
    is_active = True

    def __init__(self, token: ManagementToken) -> None:
        self.token = token
        self.is_staff = token.is_operator
        self.is_superuser = False
        self.pk = None

    def get_username(self) -> str:
        return f"token:{self.token.public_id}"

    def __str__(self) -> str:
        return self.get_username()


class ManagementTokenAuthentication(BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[TokenUser, ManagementToken] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword.lower().encode():
            return None  # not ours: the session authenticator may still apply
        if len(parts) != 2:
            raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <token>'.")
        try:
            plaintext = parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed("Invalid management token.") from None
        token = authenticate_token(plaintext)
        if token is None:
            raise AuthenticationFailed(
                f"Invalid, expired or revoked management token (expected {TOKEN_SCHEME}_...; "
                "/v1 API keys are not accepted here)."
            )
        return TokenUser(token), token

    def authenticate_header(self, request: Request) -> str:
        return f'{self.keyword} realm="api"'


def authenticate_token(plaintext: str) -> ManagementToken | None:
    prefix = parse_token(plaintext)
    if prefix is None:
        return None
    now = timezone.now()
    token = (
        ManagementToken.objects.select_related("tenant")
        .filter(prefix=prefix, revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .first()
    )
    if token is None or not digests_match(plaintext, token.digest):
        return None
    if token.last_used_at is None or now - token.last_used_at > _TOUCH_EVERY:
        ManagementToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
