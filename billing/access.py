"""Who may read a tenant's money figures (cost reports, costs in the usage API).

Decision: cost reports are finance data, for the tenant's owners and admins, tenant-admin
tokens and operators. A member (read-only role) sees the tenant's token usage and quotas on the
dashboard and through the usage API, but not what it cost: the reports answer 403 (the member
knows the tenant exists), and the usage API leaves out `cost_micros` for them. Outsiders get 404
from tenants.access before this is asked.
"""

from __future__ import annotations

from tenants.access import Principal
from tenants.models import Tenant


def can_read_costs(principal: Principal, tenant: Tenant) -> bool:
    return principal.can_manage(tenant)
