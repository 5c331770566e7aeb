"""What a management token's scope allows: every /api/ view declares, per HTTP method, the scope
a token needs (`token_scopes`), and TokenScopeRequired (in REST_FRAMEWORK's default permission
classes, after IsAuthenticated) refuses a token without it with a 403 in the API's error shape.

Scopes rank read < keys < full (tenants.models.SCOPE_ORDER):
- read: every GET (what a tenant admin may read);
- keys: read, plus creating and changing projects and API keys (issue, rotate, revoke), but
  not their allotments (`require_scope_for`: an allotment carves the tenant's shared pool);
- full: everything a tenant admin may do (members, invitations, tokens, limits, webhooks...).

Console sessions are not tokens: their role in the tenant decides (tenants.access), not this.
The check runs before the view looks anything up, so it says nothing about which tenants exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from tenants.models import ManagementToken

READ: Final = ManagementToken.Scope.READ
KEYS: Final = ManagementToken.Scope.KEYS
FULL: Final = ManagementToken.Scope.FULL

# The default every view starts from (ManagementAPIView.token_scopes): reads need `read`, any
# change `full`. Views that change projects or keys lower their writes to `keys`.
READS_AND_FULL_WRITES: Final[Mapping[str, str]] = {
    "GET": READ, "HEAD": READ, "OPTIONS": READ,
    "POST": FULL, "PUT": FULL, "PATCH": FULL, "DELETE": FULL,
}


def required_scope(view: Any, method: str) -> str:
    """The scope a token needs for `method` on `view`. A view that declares nothing (one that is
    not a ManagementAPIView, such as the schema's) is read for safe methods and full otherwise."""
    declared: Mapping[str, str] = getattr(view, "token_scopes", READS_AND_FULL_WRITES)
    fallback = READ if method in SAFE_METHODS else FULL
    return declared.get(method.upper(), fallback)


class TokenScopeRequired(BasePermission):
    """403 for a management token whose scope does not cover the view's method."""

    def has_permission(self, request: Request, view: Any) -> bool:
        token = request.auth
        if not isinstance(token, ManagementToken):
            return True  # a console session: its role decides, in the view
        needed = required_scope(view, request.method or "GET")
        if token.allows(needed):
            return True
        # An instance attribute: DRF reads `message` off the permission that refused.
        self.message = (f"This management token's scope is '{token.scope}'; this request needs "
                        f"'{needed}'.")
        return False


def require_scope_for(request: Request, needed: str, what: str, why: str) -> None:
    """403 (PermissionDenied, the API's error shape) when a management token's scope does not
    cover `needed` for part of a request its view lets a narrower token make: `what` the request
    does, `why` it needs more. Console sessions pass: their role was checked by the view."""
    token = request.auth
    if isinstance(token, ManagementToken) and not token.allows(needed):
        raise PermissionDenied(f"This management token's scope is '{token.scope}'; {what} "
                               f"needs '{needed}': {why}")
