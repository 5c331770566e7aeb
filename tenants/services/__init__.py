"""Everything that changes tenants, projects, keys, plans and management tokens. Each service runs
in one transaction and records one AuditEvent when it changes something (a call that changes
nothing records nothing); a change the gateways cache is published to them after commit.

Services update the instance they are given, so a caller holding it sees the new state.

The submodules are the homes, one per entity:
- `tenants`: create_tenant, change_plan, set_tenant_limits, set_tenant_status, rename_tenant
- `projects`: create_project, update_project
- `api_keys`: issue_key, rotate_key, revoke_key, update_key, touch_last_used
- `plans`: create_plan, update_plan, delete_plan
- `management_tokens`: issue_management_token, revoke_management_token
- `limits`: check_project_limits, check_key_limits (sub-limits only narrow)
- `allotments`: check_allotments, lock_tenant (allotments fit the tenant's quota and nest:
  tenants/allotments.py)
- `audit`: record_audit_event (the other apps' services record through it too)
- `_base`: what they share: `update` (lock, diff, save, audit, publish) and `record_change`.

This package re-exports their public API, so `from tenants.services import issue_key` works;
new code may import from the submodule. Members and invitations are in tenants.membership.
"""

from tenants.services.api_keys import (
    KEY_EDIT_FIELDS,
    IssuedKey,
    issue_key,
    revoke_key,
    rotate_key,
    touch_last_used,
    update_key,
)
from tenants.services.audit import record_audit_event
from tenants.services.limits import check_key_limits, check_project_limits
from tenants.services.management_tokens import (
    IssuedToken,
    authenticate_management_token,
    issue_management_token,
    revoke_management_token,
)
from tenants.services.plans import PLAN_FIELDS, create_plan, delete_plan, update_plan
from tenants.services.projects import PROJECT_EDIT_FIELDS, create_project, update_project
from tenants.services.tenants import (
    TENANT_OVERRIDE_FIELDS,
    change_plan,
    create_tenant,
    rename_tenant,
    set_tenant_limits,
    set_tenant_status,
)

__all__ = [
    "KEY_EDIT_FIELDS",
    "PLAN_FIELDS",
    "PROJECT_EDIT_FIELDS",
    "TENANT_OVERRIDE_FIELDS",
    "IssuedKey",
    "IssuedToken",
    "authenticate_management_token",
    "change_plan",
    "check_key_limits",
    "check_project_limits",
    "create_plan",
    "create_project",
    "create_tenant",
    "delete_plan",
    "issue_key",
    "issue_management_token",
    "record_audit_event",
    "rename_tenant",
    "revoke_key",
    "revoke_management_token",
    "rotate_key",
    "set_tenant_limits",
    "set_tenant_status",
    "touch_last_used",
    "update_key",
    "update_plan",
    "update_project",
]
