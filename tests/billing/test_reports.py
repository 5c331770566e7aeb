"""Finance reports: every total equals the ledger's sums exactly."""
from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db.models import Count, Sum
from openpyxl import load_workbook

from billing.models import UsageRecord
from billing.reports import Month, platform_month, tenant_period, to_csv, to_xlsx, usd
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.billing.rollup_events import create_usage

pytestmark = pytest.mark.django_db


def record(tenant: Tenant, rid: str, day: int, model: str, inp: int, out: int, cost: int,
           project=None, key=None, status: str = "settled", month: int = 11) -> None:
    moment = datetime(2026, month, day, 12, tzinfo=UTC)
    create_usage(
        request_id=rid, tenant=tenant, project=project, api_key=key, model=model,
        served_model=model, input_tokens=inp, output_tokens=out, cost_micros=cost,
        status=status, started_at=moment, ended_at=moment)


@pytest.fixture
def ledger() -> tuple[Tenant, Tenant]:
    acme = create_tenant("acme", plan_name="standard", actor="test")
    globex = create_tenant("globex", plan_name="free", actor="test")
    web = create_project(acme, "web", actor="test")
    batch = create_project(acme, "batch", actor="test")
    k1 = issue_key(web, actor="test").api_key
    k2 = issue_key(batch, actor="test").api_key
    record(acme, "a1", 1, "gpt-4o", 1000, 500, 7_500, web, k1)
    record(acme, "a2", 1, "gpt-4o", 10, 5, 75, web, k1)
    record(acme, "a3", 1, "gpt-4o-mini", 333, 777, 516_123, web, k1)
    record(acme, "a4", 2, "gpt-4o", 1, 1, 13, batch, k2)
    record(acme, "a5", 2, "gpt-4o", 0, 0, 0, batch, k2, status="released")
    record(acme, "a6", 30, "gpt-4o", 9, 9, 1_000_001, batch, k2)
    record(acme, "dec", 1, "gpt-4o", 50, 50, 999, batch, k2, month=12)  # another month
    record(globex, "g1", 15, "gpt-4o-mini", 7, 7, 3)
    return acme, globex


def ledger_sums(**filters) -> dict:
    return UsageRecord.objects.filter(
        ended_at__gte=datetime(2026, 11, 1, tzinfo=UTC), ended_at__lt=datetime(2026, 12, 1, tzinfo=UTC),
        **filters).aggregate(n=Count("id"), i=Sum("input_tokens"), o=Sum("output_tokens"),
                             c=Sum("cost_micros"))


def test_tenant_month_groups_by_day_project_key_model_and_totals_match_the_ledger(ledger) -> None:
    acme, _ = ledger
    report = tenant_period(acme, "2026-11")
    assert [r[:4] for r in report.rows] == [
        ("2026-11-01", "web", acme.projects.get(slug="web").api_keys.get().public_id, "gpt-4o"),
        ("2026-11-01", "web", acme.projects.get(slug="web").api_keys.get().public_id, "gpt-4o-mini"),
        ("2026-11-02", "batch", acme.projects.get(slug="batch").api_keys.get().public_id, "gpt-4o"),
        ("2026-11-30", "batch", acme.projects.get(slug="batch").api_keys.get().public_id, "gpt-4o"),
    ]
    # requests, input, output, cached input, cache writes, reasoning, cost
    assert report.rows[0][4:11] == (2, 1010, 505, 0, 0, 0, Decimal("0.007575"))
    sums = ledger_sums(tenant=acme)
    assert report.totals[4:7] == (sums["n"], sums["i"], sums["o"])
    assert report.cost_micros == sums["c"] == 1_523_712
    assert report.totals[10] == Decimal("1.523712")


def test_platform_report_has_one_row_per_tenant(ledger) -> None:
    report = platform_month(Month.parse("2026-11"))
    assert [r[:2] for r in report.rows] == [("acme", "standard"), ("globex", "free")]
    assert report.cost_micros == ledger_sums()["c"]
    assert report.totals[2] == ledger_sums()["n"] == 7


def test_csv_and_xlsx_carry_the_same_figures(ledger, tmp_path: Path) -> None:
    acme, _ = ledger
    report = tenant_period(acme, "2026-11")
    rows = list(csv.reader(io.StringIO(to_csv(report).decode())))
    assert rows[0] == list(report.columns)
    assert rows[-1][10] == "1.523712" and len(rows) == len(report.rows) + 2
    book = load_workbook(io.BytesIO(to_xlsx(report)))
    sheet = book.active
    assert [c.value for c in sheet[1]] == list(report.columns)
    assert sheet.cell(row=sheet.max_row, column=5).value == report.totals[4]
    assert round(sheet.cell(row=sheet.max_row, column=11).value, 6) == 1.523712


def test_cost_report_command(ledger, tmp_path: Path) -> None:
    out = StringIO()
    call_command("cost_report", "2026-11", "--tenant", "acme", stdout=out)
    assert ",1.523712," in out.getvalue().splitlines()[-1]
    target = tmp_path / "all.xlsx"
    out = StringIO()
    call_command("cost_report", "2026-11", "--all", "--format", "xlsx", "--out", str(target),
                 stdout=out)
    # The total cost (not the last column, which is the sweep's correction_usd).
    assert f"total {usd(ledger_sums()['c'])} USD to {target}" in out.getvalue()
    assert load_workbook(target).active.max_row == 4  # header, two tenants, total
    for bad in (["2026-13", "--tenant", "acme"], ["2026-11", "--tenant", "nope"],
                ["2026-11", "--all", "--format", "xlsx"]):
        with pytest.raises(CommandError):
            call_command("cost_report", *bad, stdout=StringIO())


def test_usd_is_exact() -> None:
    assert usd(1) == Decimal("0.000001") and usd(123_456_789) == Decimal("123.456789")


def _user(username: str, **fields):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(username, password="x-pass-123", **fields)


def test_report_downloads_are_scoped_to_the_callers_tenant(ledger, client) -> None:
    """The report is addressed by the tenant's public id (ten_...) since the management API
    (issue #5) addresses every tenant that way; access goes through tenants.access: owners and
    admins download, a member is refused (403, finance data), anyone else gets 404."""
    from tenants.models import Membership

    acme, globex = ledger
    owner, member, outsider = _user("owner"), _user("member"), _user("outsider")
    Membership.objects.create(user=owner, tenant=acme, role=Membership.Role.OWNER)
    Membership.objects.create(user=member, tenant=acme, role=Membership.Role.MEMBER)
    Membership.objects.create(user=outsider, tenant=globex, role=Membership.Role.OWNER)
    base = f"/api/tenants/{acme.public_id}/reports"
    url = f"{base}/2026-11.csv"

    assert client.get(url).status_code in (401, 403)  # anonymous
    client.force_login(owner)
    response = client.get(url)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert 'filename="acme-2026-11.csv"' in response["Content-Disposition"]
    assert response.content == to_csv(tenant_period(acme, "2026-11"))
    xlsx = client.get(f"{base}/2026-11.xlsx")
    assert load_workbook(io.BytesIO(xlsx.content)).active.max_row == 6
    assert client.get(f"{base}/2026-13.csv").status_code == 400
    assert client.get("/api/reports/2026-11.csv").status_code == 403  # platform: staff only
    assert client.get("/api/tenants/acme/reports/2026-11.csv").status_code == 404  # slugs: no

    client.force_login(member)  # sees the tenant, but cost reports are for owners and admins
    assert client.get(url).status_code == 403
    client.force_login(outsider)  # another tenant's owner
    assert client.get(url).status_code == 404
    assert client.get("/api/tenants/ten_nope/reports/2026-11.csv").status_code == 404

    client.force_login(_user("operator", is_staff=True))
    platform = client.get("/api/reports/2026-11.xlsx")
    assert platform.status_code == 200
    assert load_workbook(io.BytesIO(platform.content)).active.max_row == 4


def test_reports_show_swept_rows_and_the_corrections_of_late_settles(ledger) -> None:
    """A corrected row is billed at its real usage (cost_usd), and the report says what the
    sweep had charged it and by how much the correction changed the bill."""
    acme, _ = ledger
    web = acme.projects.get(slug="web")
    key = web.api_keys.get()
    moment = datetime(2026, 11, 1, 12, tzinfo=UTC)
    # Corrected upward: the sweep charged the input and 40 output tokens, the stream went on.
    create_usage(
        request_id="late-up", tenant=acme, project=web, api_key=key, model="gpt-4o",
        served_model="gpt-4o", input_tokens=100, output_tokens=250, cost_micros=2_750,
        held_tokens=1000, status="settled", sweep_basis="streaming", swept_input_tokens=100,
        swept_output_tokens=40, swept_cost_micros=650, corrected_at=moment, started_at=moment,
        ended_at=moment)
    # Corrected downward: the sweep charged the whole hold, the upstream had produced nothing.
    create_usage(
        request_id="late-down", tenant=acme, project=web, api_key=key, model="gpt-4o",
        served_model="gpt-4o", held_tokens=1000, status="released", sweep_basis="forwarded",
        swept_input_tokens=100, swept_output_tokens=900, swept_cost_micros=9_250,
        corrected_at=moment, started_at=moment, ended_at=moment)
    record(acme, "still-swept", 1, "gpt-4o", 100, 900, 9_250, web, key, status="swept")

    report = tenant_period(acme, "2026-11")
    # The sweep's columns, then the window's (every row states the period it belongs to).
    assert report.columns[11:] == ("swept_requests", "corrected_requests", "sweep_charged_usd",
                                  "correction_usd", "window_start", "window_end", "time_zone")
    window = ("2026-11-01T00:00:00+00:00", "2026-12-01T00:00:00+00:00", "UTC")
    [row] = [r for r in report.rows if r[0] == "2026-11-01" and r[3] == "gpt-4o"]
    assert row[4:] == (5, 1210, 1655, 0, 0, 0, Decimal("0.019575"), 1, 2, Decimal("0.009900"),
                       Decimal("-0.007150"), *window)
    assert report.totals[11:] == (1, 2, Decimal("0.009900"), Decimal("-0.007150"), *window)
    assert report.cost_micros == ledger_sums(tenant=acme)["c"]

    platform = platform_month(Month.parse("2026-11"))
    assert platform.rows[0][:1] == ("acme",)
    assert platform.rows[0][9:] == (1, 2, Decimal("0.009900"), Decimal("-0.007150"))

    sheet = load_workbook(io.BytesIO(to_xlsx(report))).active
    assert [c.value for c in sheet[1]][11:] == list(report.columns[11:])
    assert sheet.cell(row=sheet.max_row, column=15).value == pytest.approx(-0.00715)
    assert sheet.cell(row=sheet.max_row, column=15).number_format == "0.000000"


def test_reports_show_the_token_classes_with_totals(ledger) -> None:
    """Cached input, cache writes and reasoning are columns of their own (parts of the input and
    output totals, which stay what quota counted), summed in the totals row, in the CSV and the
    XLSX alike."""
    acme, globex = ledger
    web = acme.projects.get(slug="web")
    key = web.api_keys.get()
    moment = datetime(2026, 11, 3, 12, tzinfo=UTC)
    for rid, classes in (("c1", (6_000, 2_000, 400)), ("c2", (1_000, 0, 0))):
        create_usage(
            request_id=rid, tenant=acme, project=web, api_key=key, model="claude-sonnet-4-5",
            served_model="claude-sonnet-4-5", input_tokens=10_000, output_tokens=1_000,
            cached_input_tokens=classes[0], cache_write_tokens=classes[1],
            reasoning_tokens=classes[2], cost_micros=30_300, status="settled",
            started_at=moment, ended_at=moment)
    create_usage(
        request_id="g-cached", tenant=globex, model="gpt-4o", served_model="gpt-4o",
        input_tokens=100, output_tokens=10, cached_input_tokens=64, cost_micros=290,
        status="settled", started_at=moment, ended_at=moment)

    report = tenant_period(acme, "2026-11")
    assert report.columns[4:11] == ("requests", "input_tokens", "output_tokens",
                                    "cached_input_tokens", "cache_write_tokens",
                                    "reasoning_tokens", "cost_usd")
    [row] = [r for r in report.rows if r[3] == "claude-sonnet-4-5"]
    assert row[:11] == ("2026-11-03", "web", key.public_id, "claude-sonnet-4-5", 2, 20_000,
                        2_000, 7_000, 2_000, 400, Decimal("0.060600"))
    sums = UsageRecord.objects.filter(tenant=acme, ended_at__month=11).aggregate(
        c=Sum("cached_input_tokens"), w=Sum("cache_write_tokens"), r=Sum("reasoning_tokens"))
    assert report.totals[7:10] == (sums["c"], sums["w"], sums["r"]) == (7_000, 2_000, 400)

    platform = platform_month(Month.parse("2026-11"))
    assert platform.columns[2:9] == ("requests", "input_tokens", "output_tokens",
                                     "cached_input_tokens", "cache_write_tokens",
                                     "reasoning_tokens", "cost_usd")
    assert [r[5:8] for r in platform.rows] == [(7_000, 2_000, 400), (64, 0, 0)]
    assert platform.totals[5:8] == (7_064, 2_000, 400)

    rows = list(csv.reader(io.StringIO(to_csv(report).decode())))
    assert rows[-1][7:10] == ["7000", "2000", "400"]
    sheet = load_workbook(io.BytesIO(to_xlsx(report))).active
    assert [sheet.cell(row=sheet.max_row, column=c).value for c in (8, 9, 10)] == [
        7_000, 2_000, 400]
    assert sheet.cell(row=1, column=8).value == "cached_input_tokens"
