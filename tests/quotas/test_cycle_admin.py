"""The Django admin's cycle fields start from what the tenant last asked for (quotas.cycles.
asked_spec), as the API and `manage.py tenant_cycle` do. A change scheduled by change_cycle is kept
in next_cycle (the tenant's own columns keep the cycle before it until the next change folds it),
so a form filled from the columns showed a stale cycle and, saved with only a new time zone,
asked the service to go back to it: a pending billing-day cycle was cancelled, one in force was
undone. Real PostgreSQL and Redis (the change rule reads the Redis clock and counters)."""
from __future__ import annotations

from datetime import date
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from quotas.cycles import change_cycle, now_ms, schedule_for
from quotas.windows import Cycle, CycleKind
from tenants.models import AuditEvent, Tenant
from tests.quotas.test_cycle_changes import redis_ms, reload, tenant, use, wait_past

pytestmark = pytest.mark.django_db
BILLING_15 = date(2026, 1, 15)


def _page(client: Client, t: Tenant) -> Any:
    page = client.get(reverse("admin:tenants_tenant_change", args=[t.pk]))
    assert page.status_code == 200
    return page


def _shown(page: Any) -> dict[str, Any]:
    """The cycle fields as the admin's form shows them."""
    form = page.context["adminform"].form
    return {name: form[name].value() for name in
            ("cycle", "cycle_anchor", "cycle_every_days", "time_zone")}


def _post(client: Client, t: Tenant, shown: dict[str, Any], **changes: str) -> None:
    """Save the tenant's page as shown, with `changes` typed in."""
    def text(value: Any) -> str:
        return "" if value is None else value.isoformat() if isinstance(value, date) else str(value)

    form = {"slug": t.slug, "name": t.name, "plan": t.plan_id, "alert_thresholds": "[10, 5]",
            "status": "active", "forecast_threshold_percent": "80",
            **{name: text(value) for name, value in shown.items()}, **changes,
            "projects-TOTAL_FORMS": "0", "projects-INITIAL_FORMS": "0",
            "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0"}
    saved = client.post(reverse("admin:tenants_tenant_change", args=[t.pk]), form)
    assert saved.status_code == 302, saved.content.decode()[:3000]


def _changes(t: Tenant) -> int:
    return AuditEvent.objects.filter(action="tenant.cycle_changed", tenant=t).count()


def test_a_pending_billing_day_cycle_shows_and_survives_a_time_zone_edit(admin_client) -> None:
    t = tenant("enterprise")
    use(t)  # counted in its calendar month: the change waits for the month's end
    done = change_cycle(t, cycle="monthly", anchor=BILLING_15, actor="test")
    assert not done.at_once and done.changes_at is not None
    t = reload(t)
    assert t.cycle == "" and t.cycle_anchor is None  # the columns keep the cycle in force

    page = _page(admin_client, t)
    shown = _shown(page)
    assert shown == {"cycle": "monthly", "cycle_anchor": BILLING_15, "cycle_every_days": None,
                     "time_zone": "UTC"}
    html = page.content.decode()
    assert '<option value="monthly" selected>' in html and 'value="2026-01-15"' in html

    # Saved as shown: nothing asked of the service.
    before = _changes(t)
    _post(admin_client, t, shown)
    assert _changes(t) == before
    assert schedule_for(reload(t)).next == Cycle(CycleKind.MONTHLY, BILLING_15, zone="UTC")

    # Only the time zone typed in: the pending billing-day cycle stays, in the new zone, and
    # still waits for the same switch.
    _post(admin_client, t, shown, time_zone="Europe/Paris")
    t = reload(t)
    schedule = schedule_for(t)
    assert schedule.next == Cycle(CycleKind.MONTHLY, BILLING_15, zone="Europe/Paris")
    assert schedule.switch_ms == done.changes_at
    assert schedule.current == Cycle(CycleKind.MONTHLY, date(2000, 1, 1), zone="UTC")
    assert _changes(t) == before + 1
    assert _shown(_page(admin_client, t))["time_zone"] == "Europe/Paris"


def test_a_billing_day_cycle_in_force_survives_a_time_zone_edit(admin_client) -> None:
    t = tenant("enterprise")
    # Nothing counted: the change takes effect at once (the next whole second).
    done = change_cycle(t, cycle="monthly", anchor=BILLING_15, actor="test")
    assert done.at_once and done.changes_at is not None
    wait_past(done.changes_at)
    t = reload(t)
    billing_utc = Cycle(CycleKind.MONTHLY, BILLING_15, zone="UTC")
    assert schedule_for(t).cycle_at(redis_ms())[0] == billing_utc
    assert t.cycle == ""  # still the columns of the calendar month until the next change folds
    use(t)  # counted in the billing-day window: a time-zone change waits for its end

    page = _page(admin_client, t)
    shown = _shown(page)
    assert (shown["cycle"], shown["cycle_anchor"]) == ("monthly", BILLING_15)
    assert "monthly from the 15th" in page.content.decode()  # the cycle now, read-only

    _post(admin_client, t, shown, time_zone="Europe/Paris")
    t = reload(t)
    schedule = schedule_for(t)
    at = now_ms()
    assert schedule.cycle_at(at)[0] == billing_utc  # the current window finishes on it
    assert schedule.next == Cycle(CycleKind.MONTHLY, BILLING_15, zone="Europe/Paris")
    assert schedule.switch_ms is not None and schedule.switch_ms > at
    # The change was folded: the columns now hold the billing-day cycle in force.
    assert (t.cycle, t.cycle_anchor, t.time_zone) == ("monthly", BILLING_15, "UTC")
