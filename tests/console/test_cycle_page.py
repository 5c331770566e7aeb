"""The console's Limits & plan page shows the tenant's reset cycle, its current window and a
pending change, read-only (operators change it)."""
from __future__ import annotations

import re
from datetime import UTC, datetime

from django.test import Client
from django.urls import reverse

from quotas.cycles import calendar_for, change_cycle
from quotas.engine import UNLIMITED, ReserveRequest, ScopeLimit
from quotas.keys import tenant_tag
from quotas.runtime import get_engine
from quotas.windows import WindowKind
from tenants.models import Tenant
from tests.world import World


def _page(world: World, user) -> str:
    client = Client()
    client.force_login(user)
    response = client.get(reverse("console-limits", args=[world.acme.public_id]))
    assert response.status_code == 200
    return response.content.decode()


def _text(html: str, testid: str) -> str:
    found = re.search(rf'data-testid="{testid}">(.*?)</dd>', html, re.S)
    assert found is not None, testid
    return found.group(1)


def test_the_limits_page_shows_the_cycle_its_window_and_a_pending_change(world: World) -> None:
    html = _page(world, world.member)
    assert _text(html, "cycle").startswith("monthly (calendar month), UTC")
    window = calendar_for(world.acme).window(WindowKind.MONTH, get_engine().clock.now_ms())
    assert _text(html, "cycle-window").endswith("(UTC)") and window.id.startswith("m")
    assert 'data-testid="cycle-pending"' not in html
    assert "name=\"cycle\"" not in html  # read-only: no field to change it

    engine = get_engine()
    hold = engine.reserve(ReserveRequest(tenant_tag(world.acme.pk), "used", 5, (
        ScopeLimit("tenant", WindowKind.MONTH, UNLIMITED),))).hold
    assert hold is not None
    engine.settle(hold, 5)
    change_cycle(Tenant.objects.select_related("plan").get(pk=world.acme.pk), cycle="",
                 time_zone="Europe/Paris", actor="test")
    html = _page(world, world.owner)
    pending = _text(html, "cycle-pending")
    assert pending.startswith("monthly (calendar month), Europe/Paris, from ")
    switch = datetime.fromtimestamp(window.end_ms / 1000, UTC)  # the calendar month's end
    assert f"from {switch:%Y-%m-%d %H:%M} (UTC), when the current window ends" in pending
