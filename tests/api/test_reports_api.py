"""Cost report downloads through the management API: /api/tenants/<ten_...>/reports/<month>.<fmt>
for owners, admins, tenant tokens and operators (a member gets 403: finance data), and the
platform-wide /api/reports/<month>.<fmt> for operators (staff users and operator tokens)."""

from __future__ import annotations

import io
from datetime import UTC, datetime

import pytest
from openpyxl import load_workbook
from rest_framework.test import APIClient

from billing.models import UsageRecord
from billing.reports import tenant_period, to_csv
from tenants.services import issue_management_token
from tests.world import World
from tests.billing.rollup_events import create_usage


@pytest.fixture
def ledger(world: World) -> World:
    moment = datetime(2026, 11, 3, 12, tzinfo=UTC)
    for rid, tenant, project, key, tokens in (
            ("r1", world.acme, world.web, world.issued.api_key, 100),
            ("r2", world.acme, world.web, world.issued.api_key, 50),
            ("r3", world.globex, world.app, world.other_issued.api_key, 7)):
        create_usage(
            request_id=rid, tenant=tenant, project=project, api_key=key, model="gpt-4o",
            served_model="gpt-4o", input_tokens=tokens, output_tokens=tokens, cost_micros=tokens,
            status=UsageRecord.Status.SETTLED, started_at=moment, ended_at=moment)
    return world


def _url(world: World, month: str = "2026-11", fmt: str = "csv") -> str:
    return f"/api/tenants/{world.acme.public_id}/reports/{month}.{fmt}"


def _bearer(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


def test_owner_downloads_csv_and_xlsx_whatever_the_accept_header(ledger: World) -> None:
    client = ledger.client(ledger.owner)
    response = client.get(_url(ledger), HTTP_ACCEPT="text/csv")
    assert response.status_code == 200
    assert response.content == to_csv(tenant_period(ledger.acme, "2026-11"))
    assert b"gpt-4o" in response.content and b"prod" not in response.content
    xlsx = client.get(_url(ledger, fmt="xlsx"))
    assert xlsx.status_code == 200
    assert load_workbook(io.BytesIO(xlsx.content)).active.max_row == 3  # header, row, total


def test_bad_month_is_a_400_with_a_field_message(ledger: World) -> None:
    response = ledger.client(ledger.owner).get(_url(ledger, month="2026-00"))
    assert response.status_code == 400 and "month" in response.json()


def test_member_is_refused_and_outsider_sees_nothing(ledger: World) -> None:
    assert ledger.client(ledger.member).get(_url(ledger)).status_code == 403
    assert ledger.client(ledger.outsider).get(_url(ledger)).status_code == 404
    assert ledger.client(None).get(_url(ledger)).status_code in (401, 403)


def test_tokens(ledger: World) -> None:
    acme_token = issue_management_token(ledger.acme, name="finance", actor="test").plaintext
    globex_token = issue_management_token(ledger.globex, name="x", actor="test").plaintext
    ops_token = issue_management_token(None, name="ops", actor="test").plaintext

    assert _bearer(acme_token).get(_url(ledger)).status_code == 200
    assert _bearer(acme_token).get("/api/reports/2026-11.csv").status_code == 403
    assert _bearer(globex_token).get(_url(ledger)).status_code == 404
    assert _bearer(ops_token).get(_url(ledger)).status_code == 200
    platform = _bearer(ops_token).get("/api/reports/2026-11.csv")
    assert platform.status_code == 200 and b"acme" in platform.content
    assert b"globex" in platform.content
