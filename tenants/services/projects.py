"""Projects: creating one and changing its name, sub-limits or allotments."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from tenants.models import Project, Tenant
from tenants.services._base import (
    Entity,
    check_field_names,
    clean,
    insert_with_slug,
    record_change,
    update,
)
from tenants.services.allotments import (
    check_allotments,
    keys_above_project_limit_errors,
    lock_tenant,
    own_limit_errors,
    touches_allotments,
)
from tenants.services.limits import check_project_limits

PROJECT_EDIT_FIELDS: tuple[str, ...] = (
    "name", "tokens_per_day", "tokens_per_month", "pace_share_percent", "pace_spend_micros",
    "allotment_tokens_per_day", "allotment_tokens_per_month",
)


def _lock_project(project: Project) -> Project:
    return (
        Project.objects.select_for_update(of=("self",)).select_related("tenant__plan")
        .get(pk=project.pk)
    )


PROJECT: Entity[Project] = Entity(
    lock=_lock_project,
    tenant=lambda project: project.tenant,
    target=lambda project: project.public_id,
    invalidation=lambda project: ("tenant", project.tenant_id),  # cached with the keys
)


# A project's own token limits bound its keys' allotments: a change of one locks the tenant
# first, as a change of an allotment does, so a key's allotment raised at the same time is
# checked against the new limit (or this one against the raised allotment).
_OWN_TOKEN_LIMITS = ("tokens_per_day", "tokens_per_month")


def _lock_project_and_tenant(project: Project) -> Project:
    # The tenant first, as every writer of allotments does (no lock-order cycle), then the row.
    lock_tenant(project.tenant_id)
    return _lock_project(project)


def _check_within_tenant(project: Project) -> None:
    check_project_limits(
        project.tenant, tokens_per_day=project.tokens_per_day,
        tokens_per_month=project.tokens_per_month,
    )
    # Lowering the project's own limit below its allotment, or below an allotment of one of
    # its keys, is refused too (the key could not be saved again otherwise).
    errors = {**keys_above_project_limit_errors(project), **own_limit_errors(project)}
    if errors:
        raise ValidationError(errors)


def create_project(
    tenant: Tenant,
    slug: str,
    *,
    actor: str,
    name: str = "",
    tokens_per_day: int | None = None,
    tokens_per_month: int | None = None,
    pace_share_percent: int | None = None,
    pace_spend_micros: int | None = None,
    allotment_tokens_per_day: int | None = None,
    allotment_tokens_per_month: int | None = None,
    within_limits: bool = False,
) -> Project:
    """With within_limits=True (the console and the API), sub-limits above the tenant's effective
    limits are refused with a ValidationError naming the field; operator tools may skip that.
    Allotments are always checked (tenants/services/allotments.py), under the tenant's lock."""
    if within_limits:
        check_project_limits(tenant, tokens_per_day=tokens_per_day, tokens_per_month=tokens_per_month)
    allotting = allotment_tokens_per_day is not None or allotment_tokens_per_month is not None
    with transaction.atomic():
        locked_tenant = lock_tenant(tenant.pk) if allotting else tenant
        project = Project(
            tenant=tenant,
            slug=slug,
            name=name or slug,
            tokens_per_day=tokens_per_day,
            tokens_per_month=tokens_per_month,
            pace_share_percent=pace_share_percent,
            pace_spend_micros=pace_spend_micros,
            allotment_tokens_per_day=allotment_tokens_per_day,
            allotment_tokens_per_month=allotment_tokens_per_month,
        )
        clean(project)
        if allotting:
            check_allotments(locked_tenant, project)
        insert_with_slug(
            project,
            taken=Project.objects.filter(tenant=tenant, slug=slug),
            kind=f"project in tenant {tenant.slug!r}",
            slug=slug,
        )
        record_change(
            PROJECT, project, actor=actor, action="project.created",
            data={
                "slug": slug,
                "name": project.name,
                "tokens_per_day": tokens_per_day,
                "tokens_per_month": tokens_per_month,
                **({"pace_share_percent": pace_share_percent} if pace_share_percent else {}),
                **({"pace_spend_micros": pace_spend_micros} if pace_spend_micros else {}),
                **({"allotment_tokens_per_day": allotment_tokens_per_day}
                   if allotment_tokens_per_day is not None else {}),
                **({"allotment_tokens_per_month": allotment_tokens_per_month}
                   if allotment_tokens_per_month is not None else {}),
            },
            # A new allotment shrinks the tenant's shared pool: its keys' cached contexts must go.
            publish=allotting,
        )
    return project


def update_project(project: Project, *, actor: str, **changes: Any) -> Project:
    """Rename a project or change its sub-limits or allotments (None removes one), within the
    tenant's limits and quota (a change of an allotment or of an own token limit locks the
    tenant first). Its own token limits cannot go below its own allotments nor below its
    unrevoked keys' allotments."""
    check_field_names(changes, PROJECT_EDIT_FIELDS, "project")
    allotting = touches_allotments(changes)
    if not allotting and not any(name in _OWN_TOKEN_LIMITS for name in changes):
        return update(
            PROJECT, project, changes, actor=actor, action="project.updated",
            check=_check_within_tenant, refresh=PROJECT_EDIT_FIELDS,
        )

    def check(locked: Project) -> None:
        _check_within_tenant(locked)
        if allotting:
            check_allotments(locked.tenant, locked)

    # PROJECT already tells the gateways to drop the whole tenant's keys (the pool changes).
    return update(
        replace(PROJECT, lock=_lock_project_and_tenant), project, changes, actor=actor,
        action="project.updated", check=check, refresh=PROJECT_EDIT_FIELDS,
    )
