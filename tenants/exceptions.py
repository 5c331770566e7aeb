"""Domain errors raised by tenants.services and tenants.selectors.

Callers (views, management commands) translate these into HTTP errors or CommandError; the
messages are written to be shown to an operator as they are.
"""

from __future__ import annotations


class TenantsError(Exception):
    """Base class for every domain error of the tenants app."""


class UnknownPlan(TenantsError):
    def __init__(self, name: str) -> None:
        super().__init__(f"Unknown plan {name!r}")
        self.name = name


class TenantNotFound(TenantsError):
    def __init__(self, slug: str) -> None:
        super().__init__(f"No tenant with slug {slug!r}")
        self.slug = slug


class ProjectNotFound(TenantsError):
    def __init__(self, tenant_slug: str, slug: str) -> None:
        super().__init__(f"No project {slug!r} in tenant {tenant_slug!r}")
        self.tenant_slug = tenant_slug
        self.slug = slug


class ApiKeyNotFound(TenantsError):
    def __init__(self, public_id: str) -> None:
        super().__init__(f"No API key with id {public_id!r}")
        self.public_id = public_id


class SlugTaken(TenantsError):
    def __init__(self, kind: str, slug: str) -> None:
        super().__init__(f"A {kind} with slug {slug!r} already exists")
        self.kind = kind
        self.slug = slug


class KeyRevoked(TenantsError):
    def __init__(self, public_id: str) -> None:
        super().__init__(f"API key {public_id} is revoked and cannot be rotated")
        self.public_id = public_id


class KeyExpired(TenantsError):
    def __init__(self, public_id: str) -> None:
        super().__init__(f"API key {public_id} has expired and cannot be rotated")
        self.public_id = public_id
