"""docs/grafana-dashboard.json: a Grafana dashboard whose every query reads a metric /metrics
really exposes (so a renamed family cannot leave a panel silently empty)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from billing import metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"
_METRIC = re.compile(r"\btollgate_[a-z_]+")
_SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("",), "gauge": ("",)}


def _panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


@pytest.mark.django_db
def test_every_query_reads_a_metric_of_the_page() -> None:
    exposed = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", metrics.render(), re.M):
        exposed.update(name + suffix for suffix in _SUFFIXES[kind])
    used = {m for p in _panels() for t in p["targets"] for m in _METRIC.findall(t["expr"])}
    assert used and used <= exposed, used - exposed
    # Each request family of gateway/metrics.py is on the dashboard (the tenant ones are
    # opt-in, so not on a shared dashboard).
    requests = {n for n in exposed if not n.startswith(("tollgate_tenant_", "tollgate_usage_rec",
                                                        "tollgate_usage_corr",
                                                        "tollgate_over_hold_",
                                                        "tollgate_webhook_",
                                                        "tollgate_reconciliation_",
                                                        "tollgate_provider_breaker_trans"))}
    bases = {re.sub(r"_(bucket|count|sum)$", "", n) for n in requests}
    on_dashboard = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}
    assert bases <= on_dashboard, bases - on_dashboard


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "endpoint"}
    for panel in _panels():
        assert panel["title"] and panel["targets"], panel
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            for used in re.findall(r"\$(\w+)", expr):
                assert used in variables or used == "__rate_interval", used
