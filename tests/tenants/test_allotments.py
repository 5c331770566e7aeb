"""Allotments through the services: every refusal (with its message, nothing changed), the
nesting of keys in projects, a lowered quota (allowed, reported, and only lowering allowed
after it), audit events and invalidations, and two admins allotting at once."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, transaction

from tenants.allotments import over_quota_warnings, tenant_allotments
from tenants.models import UNLIMITED, ApiKey, AuditEvent, Project, Tenant
from tenants.services import (
    change_plan,
    create_project,
    create_tenant,
    issue_key,
    revoke_key,
    set_tenant_limits,
    update_key,
    update_project,
)

pytestmark = pytest.mark.django_db

DAY = "allotment_tokens_per_day"
MONTH = "allotment_tokens_per_month"


@pytest.fixture
def small(db: None) -> Tenant:
    """A tenant with 1,000 tokens a day and a cycle budget of 10,000."""
    return create_tenant("small", plan_name="standard", actor="test", tokens_per_day=1000,
                         monthly_token_budget=10_000)


def _refused(call: Any, field: str) -> str:
    with pytest.raises(ValidationError) as excinfo:
        call()
    errors = excinfo.value.message_dict
    assert list(errors) == [field], errors
    return errors[field][0]


def _stored(row: Project | ApiKey) -> tuple[int | None, int | None]:
    fresh = type(row).objects.get(pk=row.pk)
    return fresh.allotment_tokens_per_day, fresh.allotment_tokens_per_month


def test_project_allotments_must_fit_in_the_daily_quota(small: Tenant) -> None:
    web = create_project(small, "web", actor="test", allotment_tokens_per_day=600)
    batch = create_project(small, "batch", actor="test")
    events = AuditEvent.objects.count()
    message = _refused(lambda: update_project(batch, actor="user:a", allotment_tokens_per_day=500),
                       DAY)
    assert message == ("Allotments would total 1,100 tokens per day; the tenant's daily quota "
                       "is 1,000.")
    assert _stored(batch) == (None, None)
    assert AuditEvent.objects.count() == events
    update_project(batch, actor="user:a", allotment_tokens_per_day=400)  # exactly the quota
    assert tenant_allotments(small)["day"].allotted == 1000
    assert tenant_allotments(small)["day"].pool == 0
    # A new project cannot be created with an allotment that does not fit either.
    message = _refused(lambda: create_project(small, "late", actor="test",
                                              allotment_tokens_per_day=1), DAY)
    assert "would total 1,001 tokens per day" in message
    assert not Project.objects.filter(slug="late").exists()
    assert _stored(web) == (600, None)


def test_cycle_allotments_must_fit_in_the_cycle_budget(small: Tenant) -> None:
    web = create_project(small, "web", actor="test", allotment_tokens_per_month=9000)
    message = _refused(lambda: issue_key(web, actor="test", allotment_tokens_per_month=9001),
                       MONTH)
    assert message == ("The allotments of project web's keys would total 9,001 tokens per "
                       "cycle; the project's allotment is 9,000.")
    other = create_project(small, "other", actor="test")
    message = _refused(lambda: issue_key(other, actor="test", allotment_tokens_per_month=1001),
                       MONTH)
    assert message == ("Allotments would total 10,001 tokens per cycle; the tenant's cycle "
                       "token budget is 10,000.")
    assert not ApiKey.objects.filter(project__tenant=small).exists()


def test_keys_of_a_project_without_allotment_are_top_level(small: Tenant) -> None:
    web = create_project(small, "web", actor="test")
    issue_key(web, actor="test", allotment_tokens_per_day=700)
    second = issue_key(web, actor="test").api_key
    message = _refused(lambda: update_key(second, actor="test", allotment_tokens_per_day=301),
                       DAY)
    assert "would total 1,001 tokens per day" in message
    # Giving the project an allotment nests its keys' inside it: the top-level total is then
    # the project's allotment, and it must hold the keys' allotments.
    message = _refused(lambda: update_project(web, actor="test", allotment_tokens_per_day=600),
                       DAY)
    assert message == ("The project's keys have allotments totalling 700 tokens per day, more "
                       "than 600: lower theirs first.")
    update_project(web, actor="test", allotment_tokens_per_day=900)
    day = tenant_allotments(small)["day"]
    assert (day.allotted, day.keys_allotted, day.pool) == (900, {web.pk: 700}, 100)
    update_key(second, actor="test", allotment_tokens_per_day=200)  # 900 in the project: fits
    _refused(lambda: update_key(second, actor="test", allotment_tokens_per_day=201), DAY)


def test_lowering_a_project_allotment_below_its_keys_is_refused(small: Tenant) -> None:
    web = create_project(small, "web", actor="test", allotment_tokens_per_day=800)
    issue_key(web, actor="test", allotment_tokens_per_day=500)
    message = _refused(lambda: update_project(web, actor="test", allotment_tokens_per_day=499),
                       DAY)
    assert "totalling 500 tokens per day, more than 499" in message
    assert _stored(web) == (800, None)
    # Removing it is allowed: its keys' allotments then count at the top level (500 <= 800).
    update_project(web, actor="test", allotment_tokens_per_day=None)
    assert tenant_allotments(small)["day"].allotted == 500


@pytest.mark.parametrize(("override", "field", "expected"), [
    ({"tokens_per_day": UNLIMITED}, DAY,
     "The tenant has no daily quota to allot from: its tokens per day are unlimited."),
    ({"monthly_token_budget": None}, MONTH,
     "The tenant has no cycle token budget to allot from: it has no monthly token budget."),
])
def test_a_window_without_quota_has_nothing_to_allot(
    small: Tenant, override: dict[str, Any], field: str, expected: str
) -> None:
    set_tenant_limits(small, actor="test", **override)
    web = create_project(small, "web", actor="test")
    assert _refused(lambda: update_project(web, actor="test", **{field: 1}), field) == expected
    assert _refused(lambda: issue_key(web, actor="test", **{field: 1}), field) == expected
    assert _stored(web) == (None, None)


def test_an_allotment_above_the_scopes_own_limit_is_refused(small: Tenant) -> None:
    web = create_project(small, "web", actor="test", tokens_per_day=300)
    message = _refused(lambda: update_project(web, actor="test", allotment_tokens_per_day=301),
                       DAY)
    assert message == ("Must be at most 300, the project's own tokens per day: tokens allotted "
                       "above it could never be used.")
    # A key's allotment: above its own limit, or above its project's.
    message = _refused(lambda: issue_key(web, actor="test", tokens_per_day=100,
                                         allotment_tokens_per_day=101), DAY)
    assert message.startswith("Must be at most 100, the key's own tokens per day")
    message = _refused(lambda: issue_key(web, actor="test", allotment_tokens_per_day=301), DAY)
    assert message.startswith("Must be at most 300, its project's own tokens per day")
    key = issue_key(web, actor="test", tokens_per_month=50, allotment_tokens_per_month=50).api_key
    # Lowering the scope's own limit below its allotment is refused too.
    update_project(web, actor="test", allotment_tokens_per_day=200)
    message = _refused(lambda: update_project(web, actor="test", tokens_per_day=199), DAY)
    assert message.startswith("Must be at most 199")
    message = _refused(lambda: update_key(key, actor="test", tokens_per_month=49), MONTH)
    assert message.startswith("Must be at most 49, the key's own tokens per month")
    assert Project.objects.get(pk=web.pk).tokens_per_day == 300


def test_a_project_limit_below_a_keys_allotment_is_refused(small: Tenant) -> None:
    # Accepted before, it left the key unsavable: every later update_key (even a rename, and the
    # console's key forms always send the allotments) was refused against the project's limit.
    set_tenant_limits(small, actor="test", tokens_per_day=10_000, monthly_token_budget=50_000)
    web = create_project(small, "web", actor="test", tokens_per_day=1000, tokens_per_month=5000)
    key = issue_key(web, actor="test", name="batch", allotment_tokens_per_day=800,
                    allotment_tokens_per_month=3000).api_key
    issue_key(web, actor="test", name="small", allotment_tokens_per_day=600)
    issue_key(web, actor="test", allotment_tokens_per_month=4500)  # unnamed
    gone = issue_key(web, actor="test", allotment_tokens_per_day=900).api_key
    revoke_key(gone, actor="test")  # a revoked key holds no allotment: it bounds nothing
    events = AuditEvent.objects.count()
    message = _refused(lambda: update_project(web, actor="user:a", tokens_per_day=500),
                       "tokens_per_day")
    assert message == (f"Must be at least 800, the allotment per day of key batch "
                       f"({key.public_id}) (and 1 other key): tokens allotted above the "
                       "project's own limit could never be used. Lower the key's allotment "
                       "first.")
    # Per window, each on its own field; a rename in the same change is not saved either.
    with pytest.raises(ValidationError) as excinfo:
        update_project(web, actor="user:a", name="Web", tokens_per_day=799,
                       tokens_per_month=4499)
    errors = excinfo.value.message_dict
    assert sorted(errors) == ["tokens_per_day", "tokens_per_month"], errors
    assert errors["tokens_per_day"][0].startswith("Must be at least 800, the allotment per day")
    unnamed = ApiKey.objects.get(project=web, name="", allotment_tokens_per_month=4500)
    assert errors["tokens_per_month"][0].startswith(
        f"Must be at least 4,500, the allotment per cycle of key {unnamed.public_id}: ")
    fresh = Project.objects.get(pk=web.pk)
    assert (fresh.name, fresh.tokens_per_day, fresh.tokens_per_month) == ("web", 1000, 5000)
    assert AuditEvent.objects.count() == events
    # Down to the largest allotment is allowed, and the key can still be edited.
    update_project(web, actor="user:a", tokens_per_day=800, tokens_per_month=4500)
    update_key(key, actor="user:a", name="renamed", allotment_tokens_per_day=800,
               allotment_tokens_per_month=3000)
    assert ApiKey.objects.get(pk=key.pk).name == "renamed"
    # Lowering the key's allotment first lets the project's limit follow.
    update_key(key, actor="user:a", allotment_tokens_per_day=500)
    _refused(lambda: update_project(web, actor="user:a", tokens_per_day=500), "tokens_per_day")
    update_key(ApiKey.objects.get(project=web, name="small"), actor="user:a",
               allotment_tokens_per_day=None)
    update_project(web, actor="user:a", tokens_per_day=500)
    assert Project.objects.get(pk=web.pk).tokens_per_day == 500


def test_a_lowered_quota_is_allowed_reported_and_only_lowering_follows(small: Tenant) -> None:
    web = create_project(small, "web", actor="test", allotment_tokens_per_day=600)
    batch = create_project(small, "batch", actor="test", allotment_tokens_per_day=400)
    assert over_quota_warnings(small) == []
    # A plan change or an override below the allotments is not refused...
    set_tenant_limits(small, actor="operator", tokens_per_day=700)
    day = tenant_allotments(small)["day"]
    assert (day.allotted, day.quota, day.pool, day.over) == (1000, 700, 0, 300)
    # ...but reported, with what to do.
    assert over_quota_warnings(small) == [
        "Allotments total 1,000 tokens per day, more than the tenant's daily quota of 700: the "
        "shared pool is empty and the allotments cannot all be honoured. Lower them by 300 "
        "tokens."]
    # Lowering an allotment is allowed although the total stays above the quota...
    update_project(web, actor="test", allotment_tokens_per_day=500)
    # ...raising one is not, nor is anything that adds to the excess.
    message = _refused(lambda: update_project(batch, actor="test", allotment_tokens_per_day=401),
                       DAY)
    assert "would total 901 tokens per day; the tenant's daily quota is 700" in message
    # A key's allotment inside web's adds nothing to the top-level total: allowed.
    issue_key(web, actor="test", allotment_tokens_per_day=100)
    assert tenant_allotments(small)["day"].allotted == 900
    # A plan's limit counts as the quota too: moving to "free" (500,000 a day) lifts the excess.
    set_tenant_limits(small, actor="operator", tokens_per_day=None)
    change_plan(small, "free", actor="operator")
    assert over_quota_warnings(small) == []


def test_revoking_a_key_frees_its_allotment(small: Tenant) -> None:
    web = create_project(small, "web", actor="test")
    key = issue_key(web, actor="test", allotment_tokens_per_day=1000).api_key
    _refused(lambda: create_project(small, "b", actor="test", allotment_tokens_per_day=1), DAY)
    revoke_key(key, actor="test")
    create_project(small, "b", actor="test", allotment_tokens_per_day=1000)
    assert tenant_allotments(small)["day"].allotted == 1000


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    sent: list[tuple[str, Any]] = []
    monkeypatch.setattr("tenants.invalidation._publish_now",
                        lambda kind, ident: sent.append((kind, ident)))
    return sent


def test_changes_are_audited_and_drop_every_key_of_the_tenant(
    small: Tenant, published: list[tuple[str, Any]], django_capture_on_commit_callbacks: Any,
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        web = create_project(small, "web", actor="user:a", allotment_tokens_per_day=500)
        key = issue_key(web, actor="user:a").api_key
    assert published == [("tenant", small.pk)]  # the new allotment; a plain key: nothing
    assert AuditEvent.objects.get(action="project.created").data[DAY] == 500

    published.clear()
    with django_capture_on_commit_callbacks(execute=True):
        update_key(key, actor="user:a", allotment_tokens_per_day=200)
    assert published == [("tenant", small.pk)]
    event = AuditEvent.objects.filter(action="key.updated").latest("id")
    assert (event.actor, event.target, event.data) == (
        "user:a", key.public_id, {"changes": {DAY: {"from": None, "to": 200}}})

    # The same value again, and a change of another field beside an unchanged allotment:
    # only the key itself is dropped (the pool did not move).
    published.clear()
    with django_capture_on_commit_callbacks(execute=True):
        update_key(key, actor="user:a", allotment_tokens_per_day=200)
        update_key(key, actor="user:a", name="renamed", allotment_tokens_per_day=200)
    assert published == [("api_key", key.pk)]

    published.clear()
    with django_capture_on_commit_callbacks(execute=True):
        revoke_key(key, actor="user:a")
    assert published == [("tenant", small.pk)]  # its allotment went back to the pool


@pytest.mark.e2e  # commits its tenant (run with the tests that commit, last)
def test_two_admins_allotting_at_once_cannot_exceed_the_quota(django_db_blocker: Any) -> None:
    """Admin A sets 600 of 1,000 and holds its transaction open; admin B then asks for 600 for
    another project. B must wait for A's commit (the tenant's row lock) and then be refused:
    without the lock B would read A's project as it was (no allotment) and both would pass.

    The tenant is committed for real on a connection of its own and removed afterwards (not a
    transactional test: its flush would empty the seeded plans for every later test)."""
    from tests.gateway.conftest import committed

    def setup() -> tuple[Tenant, Project, Project]:
        tenant = create_tenant(f"race-{time.monotonic_ns()}", plan_name="standard",
                               actor="test", tokens_per_day=1000)
        return (tenant, create_project(tenant, "first", actor="test"),
                create_project(tenant, "second", actor="test"))

    tenant, first, second = committed(django_db_blocker, setup)
    a_saved = threading.Event()
    outcome: dict[str, Any] = {}

    def admin_a() -> None:
        try:
            with transaction.atomic():
                update_project(first, actor="user:a", allotment_tokens_per_day=600)
                a_saved.set()
                time.sleep(0.6)  # B is asking meanwhile
        finally:
            connection.close()

    def admin_b() -> None:
        a_saved.wait(5)
        started = time.monotonic()
        try:
            update_project(second, actor="user:b", allotment_tokens_per_day=600)
            outcome["b"] = "saved"
        except ValidationError as exc:
            outcome["b"] = exc.message_dict[DAY][0]
        finally:
            outcome["waited"] = time.monotonic() - started
            connection.close()

    try:
        with django_db_blocker.unblock():
            threads = [threading.Thread(target=admin_a), threading.Thread(target=admin_b)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(10)
        assert outcome["b"] == ("Allotments would total 1,200 tokens per day; the tenant's "
                                "daily quota is 1,000.")
        assert outcome["waited"] >= 0.4  # B waited for A's transaction to end
        allotted = committed(django_db_blocker, lambda: tenant_allotments(tenant)["day"].allotted)
        assert allotted == 600
        stored = committed(django_db_blocker, lambda: _stored(Project.objects.get(pk=second.pk)))
        assert stored == (None, None)
    finally:
        def remove() -> None:
            AuditEvent.objects.filter(tenant=tenant).delete()
            Tenant.objects.filter(pk=tenant.pk).delete()

        committed(django_db_blocker, remove)


def test_the_services_and_the_key_lookup_count_the_same_totals(small: Tenant) -> None:
    """What the services check (tenants.allotments, in Python) and what the gateway's key lookup
    reads for the pool (tenants.selectors.allotment_sums, in SQL) are the same sums: projects'
    allotments, keys of projects without one at the top level, keys of a project with one
    inside it, revoked keys freed."""
    from tenants.selectors import allotment_sums

    web = create_project(small, "web", actor="test", allotment_tokens_per_day=500,
                         allotment_tokens_per_month=4000)
    issue_key(web, actor="test", allotment_tokens_per_day=200)
    issue_key(web, actor="test", allotment_tokens_per_month=1000)
    bare = create_project(small, "bare", actor="test")
    issue_key(bare, actor="test", allotment_tokens_per_day=100, allotment_tokens_per_month=300)
    gone = issue_key(bare, actor="test", allotment_tokens_per_day=50).api_key
    revoke_key(gone, actor="test")
    totals = tenant_allotments(small)
    for project in (web, bare):
        sums = allotment_sums(project)
        assert (sums.tenant_day, sums.tenant_month) == (
            totals["day"].allotted, totals["month"].allotted) == (600, 4300)
    # Inside a project with an allotment (the only place the lookup's project sums are used).
    sums = allotment_sums(web)
    assert (sums.project_keys_day, sums.project_keys_month) == (
        totals["day"].keys_allotted[web.pk], totals["month"].keys_allotted[web.pk]) == (200, 1000)
    assert bare.pk not in totals["day"].keys_allotted
