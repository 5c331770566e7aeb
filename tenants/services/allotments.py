"""The rules a project's or a key's allotment must respect (tenants/allotments.py explains what
an allotment is). create_project, update_project, issue_key and update_key check them, so the
console, the API, the CLI and Django admin all refuse the same values with the same messages:

- per window, the top-level allotments must fit in the tenant's quota of the window, and a
  window without a quota has nothing to allot from;
- the allotments of a project's keys must fit in the project's allotment of the window;
- an allotment above the scope's own limit of the window (a key's: or its project's) could never
  be used and is refused; so is lowering a scope's own limit below its allotment, or a
  project's own limit below an allotment of one of its keys (keys_above_project_limit_errors).

A change that does not add to an excess is never refused for the totals: once a plan change or
an override has lowered the quota below the allotments, an admin can still lower (or remove) an
allotment, though the total stays above the quota until enough of them are lowered.

Concurrency: a change of an allotment locks the tenant's row first (`lock_tenant`), so two
admins allotting at once are serialised and cannot together exceed the quota; the check reads
the other allotments after the lock.
"""

from __future__ import annotations

import logging

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from tenants.allotments import (
    ALLOTMENT_FIELDS,
    WINDOWS,
    AllotmentWindow,
    Holder,
    holder_of,
    stored_holders,
    window_allotments,
)
from tenants.exceptions import TenantNotFound
from tenants.models import UNLIMITED, ApiKey, Project, Tenant
from tenants.selectors import effective_limits

log = logging.getLogger(__name__)

_NO_QUOTA = {
    "day": "The tenant has no daily quota to allot from: its tokens per day are unlimited.",
    "month": "The tenant has no cycle token budget to allot from: it has no monthly token "
             "budget.",
}
_OWN_LIMIT = {"day": "tokens per day", "month": "tokens per month"}


def touches_allotments(changes: Mapping[str, Any] | Iterable[str]) -> bool:
    """Whether a change names an allotment field (then it must lock the tenant first)."""
    return any(name in ALLOTMENT_FIELDS for name in changes)


def lock_tenant(tenant_id: int) -> Tenant:
    """The tenant's row, locked until the transaction ends, with its plan.

    FOR NO KEY UPDATE: two writers of a tenant's allotments wait for each other, and for a
    change of its quota (set_tenant_limits and change_plan lock the row FOR UPDATE), but the
    inserts of projects and keys that merely reference the row are not blocked."""
    try:
        return (
            Tenant.objects.select_for_update(no_key=True, of=("self",)).select_related("plan")
            .get(pk=tenant_id)
        )
    except Tenant.DoesNotExist:
        raise TenantNotFound(str(tenant_id)) from None


def _own_limit_error(
    window: AllotmentWindow, value: int, bounds: list[tuple[int | None, str]]
) -> str | None:
    for bound, whose in bounds:
        if bound is not None and value > bound:
            return (f"Must be at most {bound:,}, {whose} own {_OWN_LIMIT[window.name]}: tokens "
                    "allotted above it could never be used.")
    return None


def own_limit_errors(row: Project | ApiKey) -> dict[str, str]:
    """Per field: an allotment above the scope's own limit of its window (for a key, above its
    own or its project's). Reads only the row (and a key's project)."""
    errors: dict[str, str] = {}
    for window in WINDOWS:
        value = getattr(row, window.field)
        if value is None:
            continue
        if isinstance(row, Project):
            bounds = [(getattr(row, window.own_limit), "the project's")]
        else:
            bounds = [(getattr(row, window.own_limit), "the key's"),
                      (getattr(row.project, window.own_limit), "its project's")]
        error = _own_limit_error(window, value, bounds)
        if error:
            errors[window.field] = error
    return errors


def keys_above_project_limit_errors(project: Project) -> dict[str, str]:
    """Per own-limit field of a project (tokens_per_day, tokens_per_month): the limit is below
    the allotment of one of its unrevoked keys in that window. Such an allotment could never be
    used, and the key could not be saved again (its allotment is checked against its project's
    limit), so the project's limit is refused, as a scope's own limit below its own allotment
    is. The error names the key with the largest allotment. One query; none for a new project
    or one without own token limits."""
    limited = [w for w in WINDOWS if getattr(project, w.own_limit) is not None]
    if project.pk is None or not limited:
        return {}
    rows = list(
        ApiKey.objects.filter(project_id=project.pk, revoked_at__isnull=True)
        .exclude(allotment_tokens_per_day__isnull=True, allotment_tokens_per_month__isnull=True)
        .order_by("pk")
        .values_list("public_id", "name", *ALLOTMENT_FIELDS)
    )
    errors: dict[str, str] = {}
    for window in limited:
        limit = getattr(project, window.own_limit)
        index = 2 + ALLOTMENT_FIELDS.index(window.field)
        above = [row for row in rows if row[index] is not None and row[index] > limit]
        if not above:
            continue
        public_id, name, *_ = top = max(above, key=lambda row: row[index])
        who = f"key {name} ({public_id})" if name else f"key {public_id}"
        others = len(above) - 1
        also = f" (and {others} other key{'s' if others > 1 else ''})" if others else ""
        errors[window.own_limit] = (
            f"Must be at least {top[index]:,}, the allotment {window.per} of {who}{also}: "
            "tokens allotted above the project's own limit could never be used. Lower the "
            "key's allotment first.")
    return errors


def _replace(holders: list[Holder], new: Holder) -> tuple[list[Holder], Holder | None]:
    """`holders` with `new` in place of the stored row of the same pk (appended if unsaved),
    and the stored one (None for a new row)."""
    if new.pk is not None:
        for i, holder in enumerate(holders):
            if holder.pk == new.pk:
                return [*holders[:i], new, *holders[i + 1:]], holder
    return [*holders, new], None


# quotas.apps installs quotas.allotments.apply_allotments here (tenants cannot import quotas):
# after a change of allotments commits, the tiers in Redis take the new allotments at once, so
# what a scope took above a lowered, removed or revoked allotment is not lent out again.
_applier: Callable[[int], Any] | None = None


def set_allotments_applier(applier: Callable[[int], Any]) -> None:
    global _applier
    _applier = applier


def allotments_changed(tenant_id: int) -> None:
    """Apply the tenant's allotments to its live tiers once the current transaction commits.
    A failure (Redis away) is logged: the tier takes its allotment at the scope's next call."""
    applier = _applier
    if applier is None:
        return

    def apply() -> None:
        try:
            applier(tenant_id)
        except Exception:  # noqa: BLE001 - the change is committed; Redis catches up later
            log.warning("could not apply the allotments of tenant %s to Redis now; each tier "
                        "takes its allotment at its scope's next call", tenant_id, exc_info=True)

    transaction.on_commit(apply)


def check_allotments(tenant: Tenant, row: Project | ApiKey) -> bool:
    """ValidationError (per allotment field) if `row`'s allotments, as they would be once saved,
    break a rule of this module; otherwise whether they differ from the stored ones (then the
    shared pool changes and every gateway must drop the tenant's cached keys).

    `tenant` is read for its quota: pass the row locked by `lock_tenant` when saving."""
    errors = own_limit_errors(row)
    projects, keys = stored_holders(tenant)
    new = holder_of(row)
    if isinstance(row, Project):
        new_projects, old = _replace(projects, new)
        new_keys = keys
    else:
        new_keys, old = _replace(keys, new)
        new_projects = projects
    limits = effective_limits(tenant)
    changed = False
    for window in WINDOWS:
        value = new.of(window)
        previous = old.of(window) if old is not None else None
        changed = changed or value != previous
        if window.field in errors:
            continue
        error = _window_error(window, getattr(limits, window.quota), row, value, previous,
                              (projects, keys), (new_projects, new_keys))
        if error:
            errors[window.field] = error
    if errors:
        raise ValidationError(errors)
    if changed:
        allotments_changed(tenant.pk)
    return changed


def _window_error(
    window: AllotmentWindow,
    quota: int,
    row: Project | ApiKey,
    value: int | None,
    previous: int | None,
    before: tuple[list[Holder], list[Holder]],
    after: tuple[list[Holder], list[Holder]],
) -> str | None:
    raised = value is not None and (previous is None or value > previous)
    if quota == UNLIMITED:
        # Nothing to carve; removing or lowering an allotment left from a quota that has since
        # been lifted is still allowed.
        return _NO_QUOTA[window.name] if raised else None
    then = window_allotments(window, quota, *before)
    now = window_allotments(window, quota, *after)
    if now.over and now.allotted > then.allotted:
        return (f"Allotments would total {now.allotted:,} tokens {window.per}; the tenant's "
                f"{window.quota_name} is {quota:,}.")
    if isinstance(row, Project):
        if value is None or row.pk is None:
            return None
        keys_total = now.keys_allotted.get(row.pk, 0)
        excess = keys_total - value
        if excess > 0 and (previous is None
                           or excess > then.keys_allotted.get(row.pk, 0) - previous):
            return (f"The project's keys have allotments totalling {keys_total:,} tokens "
                    f"{window.per}, more than {value:,}: lower theirs first.")
        return None
    # The project's allotment as stored (read after the tenant's lock, like the others).
    project_allotment = next((p.of(window) for p in before[0] if p.pk == row.project_id), None)
    if value is None or project_allotment is None:
        return None
    keys_total = now.keys_allotted.get(row.project_id, 0)
    if keys_total > project_allotment and keys_total > then.keys_allotted.get(row.project_id, 0):
        return (f"The allotments of project {row.project.slug}'s keys would total "
                f"{keys_total:,} tokens {window.per}; the project's allotment is "
                f"{project_allotment:,}.")
    return None
