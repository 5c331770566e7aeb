"""Bearer management tokens for the /api/ endpoints (`Authorization: Bearer tgm_...`): DRF's
side of it. Which token a plaintext stands for is decided by the tenants services
(authenticate_management_token)."""

from __future__ import annotations

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from tenants.management_tokens import TOKEN_SCHEME
from tenants.models import ManagementToken
from tenants.services import authenticate_management_token


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
        token = authenticate_management_token(plaintext)
        if token is None:
            raise AuthenticationFailed(
                f"Invalid, expired or revoked management token (expected {TOKEN_SCHEME}_...; "
                "/v1 API keys are not accepted here)."
            )
        return TokenUser(token), token

    def authenticate_header(self, request: Request) -> str:
        return f'{self.keyword} realm="api"'

