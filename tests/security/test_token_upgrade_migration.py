"""tenants 0006: management tokens issued before the upgrade stop having full power for ever.

The test takes the database back to tenants 0005 with Django's migration executor (only 0006 is
unapplied: nothing depends on it), writes tokens as 0005 knew them (historical models), and
migrates forward again, all inside the test's transaction (PostgreSQL's DDL is transactional),
so nothing of it outlives the test.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

BEFORE = ("tenants", "0005_management_token_scope_issuer")
AFTER = ("tenants", "0006_pre_upgrade_management_tokens")


def _migrate(target: tuple[str, str]) -> Any:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate([target])
    return executor.loader.project_state([target]).apps


@pytest.mark.django_db
def test_pre_upgrade_tokens_get_an_expiry_and_their_issuer() -> None:
    apps = _migrate(BEFORE)
    plan_model, tenant_model = apps.get_model("tenants", "Plan"), apps.get_model("tenants", "Tenant")
    user_model = apps.get_model("auth", "User")
    membership = apps.get_model("tenants", "Membership")
    token_model = apps.get_model("tenants", "ManagementToken")
    plan = plan_model.objects.create(name="upgrade", display_name="Upgrade", tokens_per_day=1,
                                     requests_per_second=1)
    acme = tenant_model.objects.create(slug="acme", name="Acme", plan=plan)
    owner = user_model.objects.create(username="olive")
    demoted = user_model.objects.create(username="dora")
    membership.objects.create(user=owner, tenant=acme, role="owner")
    membership.objects.create(user=demoted, tenant=acme, role="member")
    fixed_expiry = timezone.now() + timedelta(days=3)

    def token(name: str, created_by: str, **fields: Any) -> Any:
        return token_model.objects.create(
            tenant=fields.pop("tenant", acme), name=name, prefix=f"tgm_{name}"[:12],
            digest=name, last4="abcd", created_by=created_by, **fields)

    by_owner = token("own", "user:olive")
    by_token = token("child", f"token:{by_owner.public_id}")
    by_cli = token("cli", "cli")
    by_nobody = token("gone", "user:renamed-since")
    by_demoted = token("dem", "user:dora")
    dated = token("dated", "cli", expires_at=fixed_expiry)
    revoked = token("rev", "user:olive", revoked_at=timezone.now())
    operator = token("op", "cli", tenant=None)

    started = timezone.now()
    apps = _migrate(AFTER)
    rows = {t.name: t for t in apps.get_model("tenants", "ManagementToken").objects.all()}
    in_90_days = started + timedelta(days=90)
    for name in ("own", "child", "cli", "gone", "dem"):
        assert in_90_days <= rows[name].expires_at <= timezone.now() + timedelta(days=90)
    assert rows["own"].issued_by_id == owner.pk and rows["child"].issued_by_id == owner.pk
    assert rows["cli"].issued_by_id is None and rows["gone"].issued_by_id is None
    assert rows["own"].revoked_at is None and rows["gone"].revoked_at is None
    # Its issuer may no longer change the tenant: revoked, as the membership change would have.
    assert rows["dem"].revoked_at is not None and rows["dem"].issued_by_id is None
    event = apps.get_model("tenants", "AuditEvent").objects.get(target=by_demoted.public_id)
    assert (event.action, event.actor) == ("token.revoked", "migration:tenants.0006")
    # Untouched: a chosen expiry, a revoked token, an operator token.
    assert rows["dated"].expires_at == dated.expires_at == fixed_expiry
    assert rows["rev"].expires_at is None and rows["rev"].issued_by_id is None
    assert rows["op"].expires_at is None
    assert {by_token.pk, by_cli.pk, by_nobody.pk, revoked.pk, operator.pk} <= {
        t.pk for t in rows.values()}
