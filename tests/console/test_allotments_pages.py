"""Allotments in the console: set on the limits page (projects and keys), the key page and a new
project; refusals land on the field with the service's message and change nothing; the limits
page lists the shared pool and every allotment, and warns when a lowered quota leaves the
allotments above it."""

from __future__ import annotations

import re
from html import unescape

import pytest
from django.test import Client

from tenants.models import AuditEvent, Project
from tenants.services import create_project, set_tenant_limits, update_key, update_project
from tests.support.allotments import spend
from tests.world import World

pytestmark = pytest.mark.django_db


def login(user: object) -> Client:
    client = Client()
    client.force_login(user)
    return client


def url(world: World, page: str) -> str:
    return f"/console/t/{world.acme.public_id}/{page}/"


def text(response: object) -> str:
    return unescape(response.content.decode())  # type: ignore[attr-defined]


def _project_form(world: World, project: Project, **values: str) -> dict[str, str]:
    prefix = f"p-{project.public_id}"
    return {"form": prefix, **{f"{prefix}-{name}": value for name, value in values.items()}}


@pytest.fixture
def quota(world: World) -> World:
    set_tenant_limits(world.acme, actor="test", tokens_per_day=1000, monthly_token_budget=20_000)
    return world


def test_limits_page_without_allotments_says_so(quota: World) -> None:
    html = text(login(quota.owner).get(url(quota, "limits")))
    assert 'data-testid="allotments-none"' in html
    assert "No allotments: every project and key draws from the tenant's whole quota." in html
    assert f'<label for="id_p-{quota.web.public_id}-allotment_tokens_per_day">' in html
    # A key's allotment is set on its own page (the limits page has no per-key forms).
    key_page = text(login(quota.owner).get(url(quota, f"keys/{quota.issued.api_key.public_id}")))
    assert '<label for="id_allotment_tokens_per_month">' in key_page


def test_an_owner_allots_to_a_project_and_a_key_on_the_limits_page(quota: World) -> None:
    owner = login(quota.owner)
    response = owner.post(url(quota, "limits"), _project_form(
        quota, quota.web, allotment_tokens_per_day="600", allotment_tokens_per_month="5000"))
    assert response.status_code == 302
    quota.web.refresh_from_db()
    assert (quota.web.allotment_tokens_per_day, quota.web.allotment_tokens_per_month) == (600, 5000)
    event = AuditEvent.objects.filter(action="project.updated").latest("id")
    assert event.actor == "user:owner"
    assert event.data["changes"]["allotment_tokens_per_day"] == {"from": None, "to": 600}

    key = quota.issued.api_key
    response = owner.post(url(quota, f"keys/{key.public_id}"), {
        "name": key.name, "allotment_tokens_per_day": "250"})  # on the key's own page
    assert response.status_code == 302
    key.refresh_from_db()
    assert key.allotment_tokens_per_day == 250

    html = text(owner.get(url(quota, "limits")))
    lines = html.split('data-testid="allotment-line"')[1:]
    # The pool of the day (1,000 - 600), web, its key; then the cycle's pool and web.
    assert [line.split('data-ref="')[0].split('"')[1] for line in lines] == [
        "pool", "project", "key", "pool", "project"]
    assert 'data-window="day"' in lines[0] and ">400<" in lines[0]
    assert "project</span> web" in lines[1] and "key</span> ci" in lines[2]
    assert ">600<" in lines[1] and ">250<" in lines[2] and ">15,000<" in lines[3]
    assert "600 / 5,000" in html  # the projects table


def test_a_refused_allotment_shows_the_reason_and_changes_nothing(quota: World) -> None:
    other = create_project(quota.acme, "batch", actor="test", allotment_tokens_per_day=700)
    before = AuditEvent.objects.count()
    response = login(quota.owner).post(url(quota, "limits"), _project_form(
        quota, quota.web, allotment_tokens_per_day="400"))
    assert response.status_code == 400
    html = text(response)
    assert ("Allotments would total 1,100 tokens per day; the tenant's daily quota is 1,000."
            in html)
    # On the field, in the submitted project's form, with what was typed kept.
    form = html.split(f'id="limits-{quota.web.public_id}"')[1].split("</form>")[0]
    assert "Allotments would total" in form and 'value="400"' in form
    quota.web.refresh_from_db()
    assert quota.web.allotment_tokens_per_day is None and AuditEvent.objects.count() == before
    assert other.allotment_tokens_per_day == 700


def test_a_window_without_quota_refuses_on_the_key_page(world: World) -> None:
    key = world.issued.api_key
    response = login(world.owner).post(url(world, f"keys/{key.public_id}"), {
        "name": "ci", "allotment_tokens_per_month": "10"})
    assert response.status_code == 400
    assert ("The tenant has no cycle token budget to allot from: it has no monthly token "
            "budget." in text(response))
    key.refresh_from_db()
    assert key.allotment_tokens_per_month is None


def test_the_key_page_sets_a_key_allotment_inside_its_project(quota: World) -> None:
    update_project(quota.web, actor="test", allotment_tokens_per_day=500)
    key = quota.issued.api_key
    page = login(quota.owner)
    html = text(page.get(url(quota, f"keys/{key.public_id}")))
    assert '<label for="id_allotment_tokens_per_day">Allotment per day</label>' in html
    refused = page.post(url(quota, f"keys/{key.public_id}"), {
        "name": "ci", "allotment_tokens_per_day": "501"})
    assert refused.status_code == 400
    assert ("The allotments of project web's keys would total 501 tokens per day; the project's "
            "allotment is 500." in text(refused))
    saved = page.post(url(quota, f"keys/{key.public_id}"), {
        "name": "ci", "allotment_tokens_per_day": "500"})
    assert saved.status_code == 302
    key.refresh_from_db()
    assert key.allotment_tokens_per_day == 500


def test_a_member_sees_allotments_but_cannot_set_them(quota: World) -> None:
    update_project(quota.web, actor="test", allotment_tokens_per_day=300)
    member = login(quota.member)
    html = text(member.get(url(quota, "limits")))
    assert 'data-testid="allotment-lines"' in html and 'name="form"' not in html
    response = member.post(url(quota, "limits"), _project_form(
        quota, quota.web, allotment_tokens_per_day="1"))
    assert response.status_code == 403
    quota.web.refresh_from_db()
    assert quota.web.allotment_tokens_per_day == 300


def test_a_lowered_quota_is_shown_as_a_warning(quota: World) -> None:
    update_project(quota.web, actor="test", allotment_tokens_per_day=900)
    update_key(quota.issued.api_key, actor="test", allotment_tokens_per_day=100)
    set_tenant_limits(quota.acme, actor="operator", tokens_per_day=500)
    html = text(login(quota.member).get(url(quota, "limits")))
    assert ('role="alert" data-testid="allotments-over">Allotments total 900 tokens per day, '
            "more than the tenant's daily quota of 500: the shared pool is empty and the "
            "allotments cannot all be honoured. Lower them by 400 tokens.") in html
    pool = html.split('data-kind="pool"')[1].split("</tr>")[0]
    assert ">0<" in pool


def test_a_new_project_with_an_allotment(quota: World) -> None:
    owner = login(quota.owner)
    refused = owner.post(url(quota, "projects"), {
        "slug": "reports", "allotment_tokens_per_day": "1001"})
    assert refused.status_code == 400
    assert "Allotments would total 1,001 tokens per day" in text(refused)
    assert not Project.objects.filter(slug="reports").exists()
    created = owner.post(url(quota, "projects"), {
        "slug": "reports", "allotment_tokens_per_day": "1000"})
    assert created.status_code == 302
    assert Project.objects.get(slug="reports").allotment_tokens_per_day == 1000
    html = text(owner.get(url(quota, "projects")))
    assert 'data-testid="project-allotment">1,000 tokens a day</span>' in html


def _figures(html: str, kind: str, ref: str, window: str = "day") -> tuple[str, ...]:
    row = html.split(f'data-kind="{kind}" data-ref="{ref}" data-window="{window}"')[1]
    row = row.split("</tr>")[0]
    return tuple(re.sub(r"<[^>]+>", "", row.split(f'data-figure="{name}">')[1].split("</td>")[0])
                 for name in ("used", "borrowed", "left"))


def test_the_limits_and_key_pages_show_used_borrowed_and_the_pool(quota: World) -> None:
    from tenants.services import issue_key

    set_tenant_limits(quota.acme, actor="test", tokens_per_day=10_000)
    update_project(quota.web, actor="test", allotment_tokens_per_day=4000)
    key = quota.issued.api_key
    update_key(key, actor="test", allotment_tokens_per_day=1000)
    key.refresh_from_db()
    quota.web.refresh_from_db()
    batch = create_project(quota.acme, "batch", actor="test")
    etl = issue_key(batch, actor="test", name="etl").api_key
    # ci takes its 1,000, then 500 of web's own part; etl has no allotment: the pool lends it.
    spend(quota.web, key, 1500, "ci-1")
    spend(batch, etl, 2000, "etl-1")

    owner = login(quota.owner)
    html = text(owner.get(url(quota, "limits")))
    assert _figures(html, "key", key.public_id) == ("1,000", "500", "0")
    assert _figures(html, "project", quota.web.public_id) == ("1,500", "0", "2,500")
    pool = html.split('data-kind="pool" data-ref="" data-window="day"')[1].split("</tr>")[0]
    assert ">6,000<" in pool  # its size: 10,000 - 4,000
    assert _figures(html, "pool", "") == ("2,000", "—", "4,000")

    page = text(owner.get(url(quota, f"keys/{key.public_id}")))
    assert ('data-testid="key-allotment" data-window="day">Allotment per day: 1,000 tokens, '
            "1,000 used of it, 0 left; 500 borrowed beyond it</p>") in page


def test_the_allotments_show_without_redis(quota: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from quotas.engine import QuotaStoreUnavailable

    def down(tenant: object, **kwargs: object) -> None:
        raise QuotaStoreUnavailable("down")

    update_project(quota.web, actor="test", allotment_tokens_per_day=300)
    monkeypatch.setattr("config.console.allotment_lines.allotment_standing", down)
    html = text(login(quota.owner).get(url(quota, "limits")))
    assert _figures(html, "project", quota.web.public_id) == ("—", "—", "—")
    assert "Used, borrowed and left are unavailable: the quota store cannot be reached." in html
    assert ">300<" in html.split(f'data-ref="{quota.web.public_id}"')[1].split("</tr>")[0]
