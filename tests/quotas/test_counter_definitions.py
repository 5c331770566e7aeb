"""The counters are defined once (quotas/limits.py): the gateway reserves them and reports a
refusal under the full counter's reason, the status page, the CLI, alerts and the rebuild read
the same definitions, and every Redis key name is built in quotas/keys.py."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

from billing import alerts, rebuild
from gateway.admission import refusal_error
from gateway.auth import load_key_context
from gateway.errors import (
    insufficient_quota,
    model_not_allowed,
    model_not_priced,
    queue_full,
    queue_timeout,
    rate_limited,
    upstream_unavailable,
)
from quotas import limits as definitions
from quotas.engine import UNLIMITED, ReserveRequest, Unit
from quotas.keys import tenant_tag
from quotas.limits import REFUSAL_REASONS, request_counters, request_limits, standing_counters
from quotas.runtime import get_engine
from quotas.status import quota_status
from quotas.windows import WindowKind
from tenants.api_key_format import parse_key
from tenants.models import ApiKey, Project, Tenant
from tenants.selectors import effective_limits
from tenants.services import create_project, create_tenant, issue_key, set_tenant_limits

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def acme() -> Tenant:
    tenant = create_tenant("acme", plan_name="free", actor="test")
    set_tenant_limits(tenant, actor="test", tokens_per_minute=10_000,
                      monthly_spend_budget_micros=5_000_000, monthly_token_budget=9_000_000,
                      model_tokens_per_day={"gpt-4o": 5000})
    tenant.refresh_from_db()
    return tenant


@pytest.fixture
def web(acme: Tenant) -> Project:
    return create_project(acme, "web", actor="test", tokens_per_day=1000, tokens_per_month=20000)


def test_every_counter_of_a_call_has_a_label_and_a_known_reason(acme: Tenant, web: Project) -> None:
    api_key = issue_key(web, actor="test", name="ci", tokens_per_day=300,
                        tokens_per_month=3000).api_key
    counters = request_counters(acme, effective_limits(acme), web, api_key, "gpt-4o")
    assert [(c.kind, c.scope, c.window, c.unit, c.label, c.reason) for c in counters] == [
        ("tenant", "tenant", WindowKind.DAY, Unit.TOKENS, acme.name, "quota_tenant"),
        ("tenant", "tenant", WindowKind.MONTH, Unit.TOKENS, acme.name, "quota_tenant"),
        ("project", f"project:{web.pk}", WindowKind.DAY, Unit.TOKENS, "web", "quota_project"),
        ("key", f"key:{api_key.pk}", WindowKind.DAY, Unit.TOKENS, "ci", "quota_key"),
        ("model", "model:gpt-4o", WindowKind.DAY, Unit.TOKENS, "gpt-4o", "quota_model"),
        ("project", f"project:{web.pk}", WindowKind.MONTH, Unit.TOKENS, "web", "quota_project"),
        ("key", f"key:{api_key.pk}", WindowKind.MONTH, Unit.TOKENS, "ci", "quota_key"),
        ("tenant", "tenant", WindowKind.MINUTE, Unit.TOKENS, acme.name, "tokens_per_minute"),
        ("tenant", "tenant", WindowKind.MONTH, Unit.MICROS, acme.name, "spend_budget"),
    ]
    assert [c.limit for c in counters] == [500_000, 9_000_000, 1000, 300, 5000, 20000, 3000,
                                           10_000, 5_000_000]
    assert {c.reason for c in counters} <= set(REFUSAL_REASONS)


def test_every_reason_the_gateway_reports_is_on_the_status_page(acme: Tenant,
                                                                 web: Project) -> None:
    api_key = issue_key(web, actor="test", tokens_per_month=3000).api_key
    counters = request_counters(acme, effective_limits(acme), web, api_key, "gpt-4o")
    reported = {c.reason for c in counters} | {
        insufficient_quota("tenant", "day", 1).refusal,
        rate_limited("slow down", 1).refusal,
        model_not_allowed("gpt-4o").refusal,
        model_not_priced("gpt-4o-2099-01-01").refusal,
        definitions.CONCURRENCY,  # gateway/admission.py
        queue_full(100).refusal, queue_timeout("the tenant's day", 1.0, 1).refusal,
        definitions.SPEND_RATE_EXCEEDED,  # a pace counter (acme has no pace rule): runtime.py
        upstream_unavailable(1).refusal,  # every key's breaker open: gateway/forward.py
        definitions.QUOTA_POOL,  # the shared pool of a tenant with allotments (allotment_chain)
    }
    # Every reason the gateway can count is listed (with a label), and every listed one can be.
    assert reported == set(REFUSAL_REASONS)
    assert all(REFUSAL_REASONS[reason] for reason in reported)


def test_the_gateway_caches_the_definitions_and_reports_the_full_counters_reason(
    acme: Tenant, web: Project
) -> None:
    issued = issue_key(web, actor="test", tokens_per_day=300, tokens_per_month=3000)
    ctx = load_key_context(parse_key(issued.plaintext))
    assert ctx is not None
    expected = request_counters(acme, effective_limits(acme), web, issued.api_key, "gpt-4o")
    scopes = ctx.scopes("gpt-4o")
    assert ctx.scopes("gpt-4o") is scopes  # memoised: no work per request
    assert [(s.scope, s.window, s.unit, s.limit, s.label, s.reason) for s in scopes] == [
        (c.scope, c.window, c.unit, c.limit, c.label, c.reason) for c in expected]

    engine = get_engine()
    for index, counter in enumerate(expected):
        # Only this counter is full: the refusal is reported under its reason.
        only = tuple(replace(s, limit=0 if i == index else UNLIMITED)
                     for i, s in enumerate(scopes))
        reservation = engine.reserve(ReserveRequest(
            ctx.tenant_tag, f"full-{index}", 1, only, money_amount=1))
        assert not reservation.admitted
        assert reservation.refused is not None
        assert (reservation.refused.scope, reservation.refused.reason,
                reservation.refused.label) == (counter.scope, counter.reason, counter.label)
        assert refusal_error(reservation).refusal == counter.reason


def test_status_cli_alerts_and_rebuild_read_the_same_definitions(
    acme: Tenant, web: Project
) -> None:
    create_project(acme, "batch", actor="test")
    api_key = issue_key(web, actor="test", name="ci", tokens_per_month=3000).api_key
    issue_key(web, actor="test")  # a key without a name: labelled with its public id
    limits = effective_limits(acme)

    status = quota_status(acme)
    projects = Project.objects.filter(tenant=acme).order_by("slug")
    keys_ = ApiKey.objects.filter(project__tenant=acme, revoked_at__isnull=True).order_by(
        "project__slug", "name", "public_id")
    defined = standing_counters(acme, limits, projects, keys_)
    assert [(s.kind, s.ref, s.label, s.window, s.limit, s.redis_scope) for s in status.scopes] == [
        (c.kind, c.ref, c.label, c.window.value, c.limit, c.scope) for c in defined]
    assert ("key", api_key.public_id, "ci", "month") in {
        (s.kind, s.ref, s.label, s.window) for s in status.scopes}

    out = StringIO()
    call_command("quota_show", "acme", "--json", stdout=out)
    shown = json.loads(out.getvalue())["counters"]
    assert [(r["scope"], r["label"], r["window"]) for r in shown] == [
        (c.scope, c.label, c.window.value) for c in defined]

    watched = alerts._watched([acme])
    assert {w.reason for w in watched} <= set(alerts._QUOTA_REFUSALS)
    assert [(w.scope, w.kind, w.limit, w.label) for w in watched] == [
        (c.scope, c.window, c.limit, "tenant" if c.kind == "tenant" else f"project:{c.label}")
        for c in defined if c.kind in ("tenant", "project") and c.limit > 0]

    restored = rebuild._scopes(acme, limits, web, api_key, "gpt-4o")
    assert restored == request_limits(acme, limits, web, api_key, "gpt-4o")
    # A deleted project and key: the tenant's and the model's counters only.
    assert {s.scope for s in rebuild._scopes(acme, limits, None, None, "gpt-4o")} == {
        "tenant", "model:gpt-4o"}


# The one Redis name outside quotas/keys.py: the Django cache's prefix (it prefixes keys Django
# builds itself). The pub/sub channels are named in quotas/keys.py too.
_NOT_KEYS = {
    "config/settings.py": '"KEY_PREFIX": "tg:cache"',
}


def test_every_redis_key_name_is_built_in_quotas_keys() -> None:
    name = re.compile(r"""f?["']tg:|\{\{t\{""")  # a key name, or a tenant's hash tag
    found = []
    apps = ("config", "tenants", "quotas", "gateway", "billing")
    for path in sorted(p for app in apps for p in (ROOT / app).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "quotas/keys.py":
            continue
        for line in path.read_text().splitlines():
            if name.search(line) and _NOT_KEYS.get(relative, "\0") not in line:
                found.append(f"{relative}: {line.strip()}")
    assert found == []
    assert tenant_tag(42) == "42"
