"""Console pages for cost reports and webhooks: who sees what, forms that write nothing on bad
input, and a webhook signing secret shown exactly once."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django.test import Client
from django.urls import reverse

from tests.world import World


def _client(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


# -- reports ------------------------------------------------------------------------------------


def _reports(world: World) -> str:
    return reverse("console-reports", args=[world.acme.public_id])


def test_reports_page_links_the_current_months_csv_and_the_link_downloads(world: World) -> None:
    client = _client(world.owner)
    html = client.get(_reports(world)).content.decode()
    month = datetime.now(UTC).strftime("%Y-%m")
    csv_link = re.search(r'<a [^>]*href="([^"]+)"[^>]*>Download CSV</a>', html).group(1)
    assert csv_link == f"/api/tenants/{world.acme.public_id}/reports/{month}.csv"
    assert f"/reports/{month}.xlsx" in html
    select = html[html.index('id="report-month"'):]
    assert '<label for="report-month">' in html
    assert select[:select.index("</select>")].count("<option") == 12
    download = client.get(csv_link)  # the session is enough
    assert download.status_code == 200 and download["Content-Type"].startswith("text/csv")


def test_reports_page_for_another_month_and_a_bad_month(world: World) -> None:
    client = _client(world.owner)
    html = client.get(_reports(world), {"month": "2025-02"}).content.decode()
    assert "/reports/2025-02.csv" in html and "Report for 2025-02" in html
    bad = client.get(_reports(world), {"month": "2025-13"})
    assert bad.status_code == 400 and "YYYY-MM" in bad.content.decode()


def test_member_sees_no_download_links(world: World) -> None:
    response = _client(world.member).get(_reports(world))
    assert response.status_code == 200
    html = response.content.decode()
    assert "Download CSV" not in html and "owners and admins" in html


@pytest.mark.parametrize("who, status", [("outsider", 404), ("operator", 200)])
def test_reports_page_isolation(world: World, who: str, status: int) -> None:
    assert _client(getattr(world, who)).get(_reports(world)).status_code == status
