"""Allotments on the console's limits page, in Chromium at laptop and phone width: the shared
pool and each allotment listed per window, an owner giving a project an allotment from its form
(and refused, on the field, when it would exceed the quota), and the warning after the quota
was lowered below the allotments; a member reads it all and has no form."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import LAPTOP, PHONE, MakeAccount, check_layout, log_in, shoot
from tests.gateway.conftest import committed

pytestmark = [pytest.mark.django_db, pytest.mark.e2e]


def _setup(django_db_blocker: Any, tenant_public_id: str) -> dict[str, str]:
    """A tenant with 10,000 tokens a day and 200,000 a cycle; project "web" with 4,000 a day
    and its key "prod" with 1,500 of them; project "batch" without, and its key "etl". prod has
    spent 2,000 (its 1,500, then 500 of web's own part), etl 1,000 (from the pool)."""
    from tenants.models import Tenant
    from tenants.services import create_project, issue_key, set_tenant_limits
    from tests.support.allotments import spend

    def setup() -> dict[str, str]:
        tenant = Tenant.objects.get(public_id=tenant_public_id)
        set_tenant_limits(tenant, actor="test", tokens_per_day=10_000,
                          monthly_token_budget=200_000)
        tenant = Tenant.objects.select_related("plan").get(pk=tenant.pk)
        web = create_project(tenant, "web", actor="test", name="Web app",
                             allotment_tokens_per_day=4_000)
        prod = issue_key(web, actor="test", name="prod", allotment_tokens_per_day=1_500).api_key
        batch = create_project(tenant, "batch", actor="test", name="Nightly batch")
        etl = issue_key(batch, actor="test", name="etl").api_key
        spend(web, prod, 2000, f"prod-{prod.public_id}")
        spend(batch, etl, 1000, f"etl-{etl.public_id}")
        return {"web": web.public_id, "prod": prod.public_id, "batch": batch.public_id,
                "etl": etl.public_id}

    return committed(django_db_blocker, setup)


def _line(page: Any, kind: str, ref: str, window: str) -> Any:
    return page.locator(f'[data-testid="allotment-line"][data-kind="{kind}"]'
                        f'[data-ref="{ref}"][data-window="{window}"]')


def test_an_owner_allots_from_the_limits_page(
    new_page: Callable[..., Any], make_account: MakeAccount, django_db_blocker: Any
) -> None:
    from tenants.models import AuditEvent, Project
    from tenants.services import set_tenant_limits

    owner = make_account("owner")
    member = make_account("member", tenant=owner)
    ids = _setup(django_db_blocker, owner.tenant_id)

    page = new_page()
    log_in(page, owner)
    page.goto(f"/console/t/{owner.tenant_id}/limits/")
    expect(page.get_by_role("heading", name="Allotments and the shared pool")).to_be_visible()
    pool = _line(page, "pool", "", "day")
    expect(pool).to_contain_text("6,000")  # 10,000 - 4,000
    expect(pool.locator('[data-figure="used"]')).to_have_text("1,000")  # etl borrowed it
    expect(pool.locator('[data-figure="left"]')).to_have_text("5,000")
    web = _line(page, "project", ids["web"], "day")
    expect(web).to_contain_text("4,000")
    expect(web.locator('[data-figure="used"]')).to_have_text("2,000")
    expect(web.locator('[data-figure="left"]')).to_have_text("2,000")
    prod = _line(page, "key", ids["prod"], "day")
    expect(prod).to_contain_text("1,500")
    expect(prod.locator('[data-figure="used"]')).to_have_text("1,500")
    expect(prod.locator('[data-figure="borrowed"]')).to_have_text("500")
    for viewport in (LAPTOP, PHONE):
        page.set_viewport_size(viewport)
        check_layout(page)
        shoot(page, "limits-allotments")
    page.set_viewport_size(LAPTOP)

    # Too much for batch: refused on its field, with the totals, and nothing saved.
    form = page.locator(f"#limits-{ids['batch']}")
    form.get_by_label("Allotment per day").fill("6001")
    form.get_by_role("button", name="Save").click()
    form = page.locator(f"#limits-{ids['batch']}")
    expect(form).to_contain_text(
        "Allotments would total 10,001 tokens per day; the tenant's daily quota is 10,000.")
    check_layout(page)
    # What fits is saved and listed, and the pool shrinks.
    form.get_by_label("Allotment per day").fill("6000")
    form.get_by_role("button", name="Save").click()
    expect(page.get_by_text("Limits of project Nightly batch saved.")).to_be_visible()
    expect(_line(page, "project", ids["batch"], "day")).to_contain_text("6,000")
    expect(_line(page, "pool", "", "day").locator("td").first).to_have_text("0")
    events = committed(django_db_blocker, lambda: list(AuditEvent.objects.filter(
        action="project.updated", target=ids["batch"]).values_list("actor", "data")))
    assert events == [(f"user:{owner.username}", {"changes": {"allotment_tokens_per_day": {
        "from": None, "to": 6000}}})]
    assert committed(django_db_blocker, lambda: Project.objects.get(
        public_id=ids["batch"]).allotment_tokens_per_day) == 6000

    # An operator lowers the quota below the allotments: the page warns, at both widths.
    from tenants.models import Tenant

    committed(django_db_blocker, lambda: set_tenant_limits(
        Tenant.objects.get(public_id=owner.tenant_id), actor="operator", tokens_per_day=8_000))
    other = new_page(viewport=PHONE)
    log_in(other, member)
    other.goto(f"/console/t/{owner.tenant_id}/limits/")
    expect(other.get_by_test_id("allotments-over")).to_contain_text(
        "Allotments total 10,000 tokens per day, more than the tenant's daily quota of 8,000")
    expect(other.locator(f"#limits-{ids['batch']}")).to_have_count(0)  # a member has no form
    check_layout(other)
    shoot(other, "limits-allotments-over")
    other.set_viewport_size(LAPTOP)
    check_layout(other)
