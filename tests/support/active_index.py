"""Whether a tenant is in the index of active tenants (quotas/active.py) that the background
jobs visit: a gateway worker writes its marks every GATEWAY_ACTIVE_FLUSH_SECONDS, so a test that
runs a job right after a call waits for this first."""
from __future__ import annotations

from quotas import active, keys
from quotas.keys import tenant_tag
from quotas.runtime import get_engine


def _shard_and_member(tenant_id: int) -> tuple[str, str]:
    tag = tenant_tag(tenant_id)
    shards = active.ActiveSettings.from_django().shards
    return keys.active_shard_key(active.shard_of(tag, shards)), tag


def indexed(tenant_id: int) -> bool:
    return get_engine().client.zscore(*_shard_and_member(tenant_id)) is not None


def unindex(tenant_id: int) -> None:
    """Take the tenant out of the index (as the sweep does once it is idle long enough)."""
    get_engine().client.zrem(*_shard_and_member(tenant_id))
