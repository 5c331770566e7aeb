"""Projects: creating one and changing its name or sub-limits."""

from __future__ import annotations

from typing import Any

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
from tenants.services.limits import check_project_limits

PROJECT_EDIT_FIELDS: tuple[str, ...] = (
    "name", "tokens_per_day", "tokens_per_month", "pace_share_percent", "pace_spend_micros",
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


def _check_within_tenant(project: Project) -> None:
    check_project_limits(
        project.tenant, tokens_per_day=project.tokens_per_day,
        tokens_per_month=project.tokens_per_month,
    )


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
    within_limits: bool = False,
) -> Project:
    """With within_limits=True (the console and the API), sub-limits above the tenant's effective
    limits are refused with a ValidationError naming the field; operator tools may skip that."""
    if within_limits:
        check_project_limits(tenant, tokens_per_day=tokens_per_day, tokens_per_month=tokens_per_month)
    with transaction.atomic():
        project = Project(
            tenant=tenant,
            slug=slug,
            name=name or slug,
            tokens_per_day=tokens_per_day,
            tokens_per_month=tokens_per_month,
            pace_share_percent=pace_share_percent,
            pace_spend_micros=pace_spend_micros,
        )
        clean(project)
        insert_with_slug(
            project,
            taken=Project.objects.filter(tenant=tenant, slug=slug),
            kind=f"project in tenant {tenant.slug!r}",
            slug=slug,
        )
        record_change(
            PROJECT, project, actor=actor, action="project.created", publish=False,
            data={
                "slug": slug,
                "name": project.name,
                "tokens_per_day": tokens_per_day,
                "tokens_per_month": tokens_per_month,
                **({"pace_share_percent": pace_share_percent} if pace_share_percent else {}),
                **({"pace_spend_micros": pace_spend_micros} if pace_spend_micros else {}),
            },
        )
    return project


def update_project(project: Project, *, actor: str, **changes: Any) -> Project:
    """Rename a project or change its sub-limits (None removes one), within the tenant's limits."""
    check_field_names(changes, PROJECT_EDIT_FIELDS, "project")
    return update(
        PROJECT, project, changes, actor=actor, action="project.updated",
        check=_check_within_tenant, refresh=PROJECT_EDIT_FIELDS,
    )
