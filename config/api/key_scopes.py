"""The key scopes of /quota and /limits a page at a time: `?key_limit=&key_offset=`.

Every unrevoked key has a live day counter (quotas.limits.key_counters), so a tenant with
20,000 keys had 20,000 key scopes in each of those documents (3.5 MB, over a second). The
tenant's, projects' and models' scopes are always all there; the keys' are the page of
quotas.status.live_keys() asked for (default KEY_SCOPES_DEFAULT, at most MAX_LIMIT, 0 for none),
and the document says how many there are and links the next page (`keys`).
"""

from __future__ import annotations

from typing import Any, Final

from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request
from rest_framework.utils.urls import replace_query_param

from config.api.pagination import MAX_LIMIT, MAX_OFFSET, bounded_int
from quotas.status import live_keys
from tenants.models import ApiKey, Tenant

KEY_SCOPES_DEFAULT: Final = 50

KEY_SCOPE_PARAMETERS = [
    OpenApiParameter("key_limit", {"type": "integer", "minimum": 0, "maximum": MAX_LIMIT},
                     description=f"Keys whose scopes are listed (default {KEY_SCOPES_DEFAULT}, "
                     f"at most {MAX_LIMIT}; 0: none). The tenant's, projects' and models' "
                     "scopes are always all listed."),
    OpenApiParameter("key_offset", {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET},
                     description="How many keys to skip (in the order of project slug, key "
                     "name, key id)."),
]


def key_scope_page(request: Request, tenant: Tenant) -> tuple[list[ApiKey], dict[str, Any]]:
    """The page of live keys asked for, and the `keys` part of the document:
    {"count", "limit", "offset", "next"} (next: null on the last page). A bad value is a 400
    naming the parameter."""
    limit = bounded_int(request, "key_limit", KEY_SCOPES_DEFAULT, 0, MAX_LIMIT)
    offset = bounded_int(request, "key_offset", 0, 0, MAX_OFFSET)
    keys = live_keys(tenant)
    count = keys.count()
    page = list(keys[offset:offset + limit]) if limit else []
    following = None
    if limit and offset + limit < count:
        following = replace_query_param(request.build_absolute_uri(), "key_offset",
                                        offset + limit)
    return page, {"count": count, "limit": limit, "offset": offset, "next": following}
