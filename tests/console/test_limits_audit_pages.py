"""Console limits, audit and management token pages: isolation, CSRF, validation, show-once."""

from __future__ import annotations

import re
from datetime import timedelta
from urllib.parse import unquote

import pytest
from django.test import Client
from django.utils import timezone

from quotas.engine import QuotaStoreUnavailable
from tenants.models import AuditEvent, ManagementToken, Tenant
from tenants.services import (
    issue_management_token,
    record_audit_event,
    set_tenant_limits,
)
from tests.world import World


def login(user: object, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def url(world: World, page: str) -> str:
    return f"/console/t/{world.acme.public_id}/{page}/"


# -- limits ----------------------------------------------------------------------------------------


def test_limits_page_shows_plan_scopes_and_remaining(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    page = login(world.owner).get(url(world, "limits"))
    assert page.status_code == 200
    html = page.content.decode()
    assert "Plan:" in html and "standard" in html
    assert "1,000 of 1,000 left" in html and "role=\"meter\"" in html  # the tenant's day, nothing used yet
    # Keys have no form here any more (a tenant may have thousands): a count and a link to
    # the keys page, where each key's page sets its limits.
    assert world.web.public_id in html and "1 active key." in html
    assert f'/console/t/{world.acme.public_id}/keys/?status=active' in html
    assert world.issued.masked not in html and "id_k-" not in html
    assert world.app.public_id not in html and world.other_issued.masked not in html
    assert f'<label for="id_p-{world.web.public_id}-tokens_per_day">' in html
    assert '<label for="id_alerts-alert_thresholds">' in html
    assert 'class="table-wrap"' in html and "<th" in html


def test_limits_page_member_reads_outsider_404(world: World) -> None:
    member = login(world.member)
    page = member.get(url(world, "limits"))
    assert page.status_code == 200
    assert 'id="alert-thresholds"' not in page.content.decode()
    assert 'name="form"' not in page.content.decode()
    assert member.post(url(world, "limits"), {"form": "alerts",
                                              "alerts-alert_thresholds": "50"}).status_code == 403
    outsider = login(world.outsider)
    assert outsider.get(url(world, "limits")).status_code == 404
    assert outsider.post(url(world, "limits"), {"form": "alerts"}).status_code == 404
    world.acme.refresh_from_db()
    assert world.acme.alert_thresholds == [10, 5]


def test_limits_page_when_redis_is_down(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    def down(tenant: Tenant, **kwargs: object) -> None:
        raise QuotaStoreUnavailable("down")

    monkeypatch.setattr("config.console.frame.quota_status", down)
    page = login(world.owner).get(url(world, "limits"))
    assert page.status_code == 200
    assert "Live counters are unavailable" in page.content.decode()


def test_set_project_sub_limit_within_tenant(world: World) -> None:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    owner = login(world.owner)
    prefix = f"p-{world.web.public_id}"
    before = AuditEvent.objects.count()
    bad = owner.post(url(world, "limits"), {"form": prefix, f"{prefix}-tokens_per_day": "2000"})
    assert bad.status_code == 400
    assert "the tenant&#x27;s daily token limit" in bad.content.decode()
    world.web.refresh_from_db()
    assert world.web.tokens_per_day is None and AuditEvent.objects.count() == before
    ok = owner.post(url(world, "limits"), {"form": prefix, f"{prefix}-tokens_per_day": "600",
                                           f"{prefix}-tokens_per_month": ""})
    assert ok.status_code == 302
    world.web.refresh_from_db()
    assert world.web.tokens_per_day == 600
    assert AuditEvent.objects.filter(action="project.updated", actor="user:owner").exists()


def test_foreign_project_form_is_404(world: World) -> None:
    prefix = f"p-{world.app.public_id}"
    response = login(world.owner).post(url(world, "limits"),
                                       {"form": prefix, f"{prefix}-tokens_per_day": "1"})
    assert response.status_code == 404
    world.app.refresh_from_db()
    assert world.app.tokens_per_day is None


@pytest.mark.parametrize(("value", "message"), [
    ("ten", "whole numbers"),
    ("0, 5", "from 1 to 99"),
    ("5, 5", "must not repeat"),
])
def test_bad_alert_thresholds_rerender(world: World, value: str, message: str) -> None:
    before = AuditEvent.objects.count()
    response = login(world.owner).post(url(world, "limits"), {
        "form": "alerts", "alerts-alert_thresholds": value})
    assert response.status_code == 400
    assert message in response.content.decode()
    world.acme.refresh_from_db()
    assert world.acme.alert_thresholds == [10, 5] and AuditEvent.objects.count() == before


def test_set_alert_thresholds(world: World) -> None:
    response = login(world.owner).post(url(world, "limits"), {
        "form": "alerts", "alerts-alert_thresholds": "5, 25"})
    assert response.status_code == 302
    world.acme.refresh_from_db()
    assert world.acme.alert_thresholds == [25, 5]


def test_limits_forms_need_csrf(world: World) -> None:
    response = login(world.owner, csrf=True).post(url(world, "limits"), {
        "form": "alerts", "alerts-alert_thresholds": "50"})
    assert response.status_code == 403


# -- audit -------------------------------------------------------------------------------------------


def test_audit_page_lists_own_events_newest_first(world: World) -> None:
    old = record_audit_event(tenant=world.acme, actor="user:old", action="key.revoked",
                             target="key_old")
    AuditEvent.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=9))
    record_audit_event(tenant=world.globex, actor="user:outsider", action="key.revoked",
                       target="key_theirs")
    page = login(world.member).get(url(world, "audit"))
    assert page.status_code == 200
    html = page.content.decode()
    assert "key_theirs" not in html and "key_old" in html
    assert html.index(world.issued.api_key.public_id) < html.index("key_old")
    assert '<label for="id_from">' in html and '<label for="id_action">' in html
    assert login(world.outsider).get(url(world, "audit")).status_code == 404


def test_audit_filters_and_bad_dates(world: World) -> None:
    old = record_audit_event(tenant=world.acme, actor="user:old", action="key.revoked",
                             target="key_old")
    AuditEvent.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=9))
    client = login(world.owner)
    today = timezone.now().date().isoformat()
    recent = client.get(url(world, "audit"), {"from": today, "to": today}).content.decode()
    assert "key_old" not in recent and "key.issued" in recent
    revoked = client.get(url(world, "audit"), {"action": "key.revoked"}).content.decode()
    assert "key_old" in revoked and world.issued.api_key.public_id not in revoked
    bad = client.get(url(world, "audit"), {"from": "2026-02-30"})
    assert bad.status_code == 400 and "Enter a valid date" in bad.content.decode()
    backwards = client.get(url(world, "audit"), {"from": today, "to": "2020-01-01"})
    assert backwards.status_code == 400


def test_audit_page_paginates(world: World) -> None:
    # A cursor to the older events (a keyset walk: no page numbers, no COUNT over the trail).
    for n in range(55):
        record_audit_event(tenant=world.acme, actor="user:bulk", action="key.updated",
                           target=f"key_bulk{n:02d}")
    client = login(world.owner)
    first = client.get(url(world, "audit"), {"action": "key.updated"}).content.decode()
    assert "key_bulk54" in first and "key_bulk05" in first and "key_bulk04" not in first
    older = re.search(r'href="\?action=key.updated&amp;after=([^"]+)">Older</a>', first)
    assert older, "an Older link keeping the filter"
    second = client.get(url(world, "audit"), {"action": "key.updated",
                                               "after": unquote(older.group(1))})
    html = second.content.decode()
    assert second.status_code == 200 and "key_bulk00" in html and "key_bulk04" in html
    assert "key_bulk05" not in html and ">Older</a>" not in html and ">Newest</a>" in html
    altered = client.get(url(world, "audit"), {"after": unquote(older.group(1))[:-2] + "xx"})
    assert altered.status_code == 400
    assert "This cursor is not one this listing gave." in altered.content.decode()


# -- management tokens --------------------------------------------------------------------------


def test_tokens_page_issues_once_and_revokes(world: World) -> None:
    owner = login(world.owner)
    response = owner.post(url(world, "tokens"), {"name": "terraform"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    html = response.content.decode()
    plaintext = re.search(r'id="new-key" value="(tgm_[0-9A-Za-z_]+)"', html).group(1)
    assert "Copy this token now. You will not see it again." in html
    token = ManagementToken.objects.get(name="terraform")
    assert token.tenant == world.acme
    listing = owner.get(url(world, "tokens")).content.decode()
    assert "terraform" in listing and plaintext not in listing
    assert plaintext not in str(dict(owner.session.items()))

    revoke = f"{url(world, 'tokens')}{token.public_id}/revoke/"
    unconfirmed = owner.post(revoke, {})
    assert unconfirmed.status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is None
    assert owner.post(revoke, {"confirm": "on"}).status_code == 302
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_tokens_page_isolation(world: World) -> None:
    own = issue_management_token(world.acme, name="ci", actor="test").token
    foreign = issue_management_token(world.globex, name="theirs", actor="test").token
    member = login(world.member)
    assert member.get(url(world, "tokens")).status_code == 200
    assert 'id="new-token"' not in member.get(url(world, "tokens")).content.decode()
    assert member.post(url(world, "tokens"), {"name": "x"}).status_code == 403
    assert member.post(f"{url(world, 'tokens')}{own.public_id}/revoke/",
                       {"confirm": "on"}).status_code == 403
    outsider = login(world.outsider)
    assert outsider.get(url(world, "tokens")).status_code == 404
    assert outsider.post(f"{url(world, 'tokens')}{own.public_id}/revoke/",
                         {"confirm": "on"}).status_code == 404
    owner = login(world.owner)
    assert owner.post(f"{url(world, 'tokens')}{foreign.public_id}/revoke/",
                      {"confirm": "on"}).status_code == 404
    assert not ManagementToken.objects.filter(revoked_at__isnull=False).exists()
    bad = owner.post(url(world, "tokens"), {"name": ""})
    assert bad.status_code == 400 and "This field is required" in bad.content.decode()
    assert ManagementToken.objects.count() == 2
    assert login(world.owner, csrf=True).post(url(world, "tokens"),
                                              {"name": "x"}).status_code == 403


def test_set_key_sub_limit_within_project(world: World) -> None:
    # On the key's own page (the limits page has no per-key forms any more).
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000)
    owner = login(world.owner)
    key_page = f"{url(world, 'keys')}{world.issued.api_key.public_id}/"
    project_prefix = f"p-{world.web.public_id}"
    owner.post(url(world, "limits"), {"form": project_prefix,
                                      f"{project_prefix}-tokens_per_day": "300"})
    bad = owner.post(key_page, {"tokens_per_day": "400"})
    assert bad.status_code == 400
    assert "the project&#x27;s daily token limit" in bad.content.decode()
    key = world.issued.api_key
    key.refresh_from_db()
    assert key.tokens_per_day is None
    ok = owner.post(key_page, {"tokens_per_day": "250", "pace_share_percent": "40"})
    assert ok.status_code == 302
    key.refresh_from_db()
    assert key.tokens_per_day == 250 and key.pace_share_percent == 40
    foreign = f"{url(world, 'keys')}{world.other_issued.api_key.public_id}/"
    assert owner.post(foreign, {"tokens_per_day": "1"}).status_code == 404
    # The old per-key form of the limits page is gone: its name is an unknown form, a 400.
    prefix = f"k-{world.issued.api_key.public_id}"
    gone = owner.post(url(world, "limits"), {"form": prefix, f"{prefix}-tokens_per_day": "1"})
    assert gone.status_code == 400
    key.refresh_from_db()
    assert key.tokens_per_day == 250
