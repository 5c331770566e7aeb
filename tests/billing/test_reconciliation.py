"""Reconciliation of the ledger against upstream bills: CSV, OpenAI usage API (over a mock
transport: it is the external API), the mock upstream's bill, drift flags, alerts, the daily
task's lock and the management command."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core import mail
from django.core.management import CommandError, call_command

from billing.bills import BillError, BillFormatError, BillLine, CsvBill, MockBill, OpenAIUsageAPI
from billing.bills import usd_to_micros
from billing.models import ReconciliationRun, UpstreamKeyAlias, UsageRecord
from billing.reconciliation import (
    DayLocked,
    day_lock,
    difference_rate,
    reconcile,
    upstream_key_id_for,
)
from billing.tasks import reconcile_daily
from gateway.mock_upstream import MockUpstream, api_key_id, ledger, start_in_thread
from gateway.models import ProviderKey
from gateway.providers import create_provider_key
from quotas.keys import reconcile_lock_key
from quotas.runtime import get_engine
from tenants.models import Tenant
from tenants.services import create_tenant

pytestmark = pytest.mark.django_db

DAY = date(2026, 11, 20)
SECRET = "sk-reconciliation-test-0001"
HEADER = "day,api_key_id,model,input_tokens,output_tokens,requests,cost_usd\n"


@pytest.fixture
def acme() -> Tenant:
    return create_tenant("acme", plan_name="free", actor="test")


@pytest.fixture
def key(acme: Tenant) -> ProviderKey:
    """A provider key dedicated to acme (so its rows carry the tenant)."""
    return create_provider_key("upstream", base_url="https://upstream.test/v1", secret=SECRET,
                               tenant=acme)


@pytest.fixture
def admins(settings: Any) -> None:
    settings.ADMINS = [("Ops", "ops@example.com")]
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"


_seq = iter(range(10**9))


def usage(key: ProviderKey | None, model: str, day: date, input_tokens: int, output_tokens: int,
          *, status: str = "settled", tenant: Tenant | None = None, hour: int = 12,
          sweep_basis: str = "") -> UsageRecord:
    moment = datetime.combine(day, time(hour), tzinfo=UTC)
    tenant = tenant or (key.tenant if key and key.tenant else Tenant.objects.first())
    return UsageRecord.objects.create(
        request_id=f"req-{next(_seq)}", tenant=tenant, provider_key=key, model=model,
        served_model=model, input_tokens=input_tokens, output_tokens=output_tokens,
        cost_micros=input_tokens + 2 * output_tokens, status=status, started_at=moment,
        ended_at=moment, sweep_basis=sweep_basis)


def csv_bill(tmp_path: Path, *lines: str, name: str = "bill.csv") -> CsvBill:
    path = tmp_path / name
    path.write_text(HEADER + "".join(f"{line}\n" for line in lines))
    return CsvBill(path)


def rows_by_model(run: ReconciliationRun) -> dict[tuple[date, str], Any]:
    return {(row.day, row.model): row for row in run.rows.all()}


KID = api_key_id(SECRET)


# --- drift -----------------------------------------------------------------------------------


def test_three_percent_drift_passes_and_seven_percent_is_flagged(
    key: ProviderKey, acme: Tenant, tmp_path: Path, admins: None, caplog: Any
) -> None:
    usage(key, "gpt-4o", DAY, 600, 200)
    usage(key, "gpt-4o", DAY, 200, 0, hour=23)
    usage(key, "gpt-4o-mini", DAY, 900, 100)
    bill = csv_bill(tmp_path,
                    f"{DAY},{KID},gpt-4o,824,206,2,0.004120",    # 1030 vs 1000: 3% over
                    f"{DAY},{KID},gpt-4o-mini,963,107,1,")       # 1070 vs 1000: 7% over
    with caplog.at_level(logging.ERROR, logger="billing.reconciliation"):
        run = reconcile(DAY, bill, provider_key=key)

    assert run.status == ReconciliationRun.Status.DRIFT
    assert (run.source, run.day, run.provider_key_id) == ("csv", DAY, key.pk)
    rows = rows_by_model(run)
    small, large = rows[(DAY, "gpt-4o")], rows[(DAY, "gpt-4o-mini")]
    assert (small.ours_input, small.ours_output, small.theirs_input, small.theirs_output) == (
        800, 200, 824, 206)
    assert small.difference == 30 and small.difference_rate == Decimal("0.029126")
    assert not small.flagged and small.note == ""
    assert small.theirs_cost_micros == 4120 and small.ours_cost_micros == 800 + 400
    assert (small.ours_requests, small.theirs_requests) == (2, 2)
    assert large.difference == 70 and large.difference_rate == Decimal("0.065421")
    assert large.flagged and large.theirs_cost_micros is None
    assert small.tenant_id == large.tenant_id == acme.pk
    assert small.api_key_id == KID
    assert (run.rows_count, run.flagged_count, run.max_difference_rate) == (
        2, 1, Decimal("0.065421"))
    assert (run.ours_input_tokens, run.ours_output_tokens) == (1700, 300)
    assert (run.theirs_input_tokens, run.theirs_output_tokens, run.theirs_cost_micros) == (
        1787, 313, 4120)

    assert len(mail.outbox) == 1
    message = mail.outbox[0]
    assert message.to == ["ops@example.com"]
    assert "drift" in message.subject and "1 row(s) flagged" in message.subject
    assert "gpt-4o-mini" in message.body and "gpt-4o:" not in message.body
    assert any(r.levelno == logging.ERROR and "drift" in r.getMessage() for r in caplog.records)


def test_within_tolerance_is_ok_and_sends_nothing(key: ProviderKey, tmp_path: Path,
                                                  admins: None) -> None:
    usage(key, "gpt-4o", DAY, 1000, 0)
    run = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,1030,0,1,"), provider_key=key)
    assert run.status == ReconciliationRun.Status.OK and run.flagged_count == 0
    assert mail.outbox == []


def test_the_tolerance_is_strictly_greater(key: ProviderKey, tmp_path: Path) -> None:
    usage(key, "gpt-4o", DAY, 95, 0)
    usage(key, "gpt-4o-mini", DAY, 94, 0)
    bill = csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,100,0,1,", f"{DAY},{KID},gpt-4o-mini,100,0,1,")
    rows = rows_by_model(reconcile(DAY, bill, provider_key=key))
    assert rows[(DAY, "gpt-4o")].difference_rate == Decimal("0.05")
    assert not rows[(DAY, "gpt-4o")].flagged  # exactly 5%: not above the tolerance
    assert rows[(DAY, "gpt-4o-mini")].flagged
    # A looser tolerance passes both; it is stored with the run.
    run = reconcile(DAY, bill, provider_key=key, tolerance=Decimal("0.10"))
    assert run.status == "ok" and run.tolerance == Decimal("0.1")


def test_difference_rate_is_relative_to_the_larger_side() -> None:
    assert difference_rate(0, 0) == 0
    assert difference_rate(100, 0) == difference_rate(0, 100) == 1
    assert difference_rate(100, 107) == Decimal(7) / Decimal(107)


# --- missing on one side, unknown model, empty bill ------------------------------------------


def test_a_day_missing_on_either_side_is_flagged(key: ProviderKey, tmp_path: Path,
                                                 admins: None) -> None:
    d1, d2, d3 = DAY, DAY + timedelta(days=1), DAY + timedelta(days=2)
    usage(key, "gpt-4o", d1, 500, 50)
    usage(key, "gpt-4o", d2, 400, 40)  # the bill has no line for this day
    bill = csv_bill(tmp_path, f"{d1},{KID},gpt-4o,500,50,1,0.01",
                    f"{d3},{KID},gpt-4o,300,30,1,0.02",   # no ledger row for this day
                    f"{DAY + timedelta(days=3)},{KID},gpt-4o,9,9,1,")  # outside the period
    run = reconcile((d1, d1 + timedelta(days=3)), bill, provider_key=key)
    assert run.day is None and (run.period_start, run.period_end) == (d1, d1 + timedelta(days=3))
    rows = rows_by_model(run)
    assert set(rows) == {(d1, "gpt-4o"), (d2, "gpt-4o"), (d3, "gpt-4o")}
    assert not rows[(d1, "gpt-4o")].flagged
    missing_theirs, missing_ours = rows[(d2, "gpt-4o")], rows[(d3, "gpt-4o")]
    assert missing_theirs.flagged and missing_theirs.note == "missing on their side"
    assert (missing_theirs.difference, missing_theirs.difference_rate) == (-440, 1)
    assert missing_theirs.theirs_cost_micros is None
    assert missing_ours.flagged and missing_ours.note == "missing on ours"
    assert (missing_ours.difference, missing_ours.ours_input) == (330, 0)
    assert run.status == "drift" and run.flagged_count == 2
    assert run.theirs_cost_micros == 30_000
    assert "2 row(s) flagged" in mail.outbox[0].subject


def test_unknown_models_are_marked(key: ProviderKey, tmp_path: Path) -> None:
    usage(key, "gpt-9-preview", DAY, 100, 10)
    bill = csv_bill(tmp_path, f"{DAY},{KID},gpt-9-preview,100,10,1,",
                    f"{DAY},{KID},mystery-model,70,7,1,")
    rows = rows_by_model(reconcile(DAY, bill, provider_key=key))
    both = rows[(DAY, "gpt-9-preview")]
    assert not both.flagged and both.note == "unknown model"
    bill_only = rows[(DAY, "mystery-model")]
    assert bill_only.flagged and bill_only.note == "missing on ours; unknown model"


def test_an_empty_bill(key: ProviderKey, tmp_path: Path) -> None:
    run = reconcile(DAY, csv_bill(tmp_path), provider_key=key)
    assert (run.status, run.rows_count, run.theirs_cost_micros) == ("ok", 0, None)

    usage(key, "gpt-4o", DAY, 10, 5)
    run = reconcile(DAY, csv_bill(tmp_path), provider_key=key)
    [row] = run.rows.all()
    assert run.status == "drift" and row.flagged and row.note == "missing on their side"


def test_only_calls_that_reached_the_upstream_count(key: ProviderKey, tmp_path: Path) -> None:
    usage(key, "gpt-4o", DAY, 100, 10)
    usage(key, "gpt-4o", DAY, 7, 3, status="partial")
    usage(key, "gpt-4o", DAY, 20, 5, status="unmetered")  # fail-open: on the bill all the same
    usage(key, "gpt-4o", DAY, 30, 12, status="swept", sweep_basis="streaming")
    usage(key, "gpt-4o", DAY, 0, 0, status="released")
    usage(key, "gpt-4o", DAY, 0, 0, status="swept", sweep_basis="reserved")  # never sent
    usage(key, "gpt-4o", DAY - timedelta(days=1), 999, 0, hour=23)  # the day before
    [row] = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,157,30,4,"),
                      provider_key=key).rows.all()
    assert (row.ours_input, row.ours_output, row.ours_requests, row.flagged) == (157, 30, 4, False)


def test_every_key_at_once_and_keys_that_are_not_ours(key: ProviderKey, acme: Tenant,
                                                      tmp_path: Path) -> None:
    shared = create_provider_key("shared", base_url="https://upstream.test/v1",
                                 secret="sk-shared-key-0002")
    usage(key, "gpt-4o", DAY, 100, 0)
    usage(shared, "gpt-4o", DAY, 200, 0, tenant=acme)
    bill = csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,100,0,1,",
                    f"{DAY},{api_key_id('sk-shared-key-0002')},gpt-4o,200,0,1,",
                    f"{DAY},key_someoneelse,gpt-4o,5,0,1,")
    run = reconcile(DAY, bill)
    rows = {row.api_key_id: row for row in run.rows.all()}
    assert rows[KID].provider_key == key and rows[KID].tenant == acme
    shared_row = rows[api_key_id("sk-shared-key-0002")]
    assert shared_row.provider_key == shared and shared_row.tenant is None
    assert not rows[KID].flagged and not shared_row.flagged
    stranger = rows["key_someoneelse"]
    assert stranger.provider_key is None and stranger.flagged
    assert stranger.note == "missing on ours; unknown upstream key"
    # Scoped to one key, the other keys' lines are not this key's business.
    assert reconcile(DAY, bill, provider_key=key).status == "ok"


# --- history ---------------------------------------------------------------------------------


def test_a_rerun_supersedes_the_previous_run_and_keeps_the_history(key: ProviderKey,
                                                                   tmp_path: Path) -> None:
    usage(key, "gpt-4o", DAY, 100, 0)
    first = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,150,0,1,"), provider_key=key)
    second = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,100,0,1,"), provider_key=key)
    other_day = reconcile(DAY + timedelta(days=1), csv_bill(tmp_path), provider_key=key)
    first.refresh_from_db()
    assert first.superseded_by == second and first.status == "drift"
    assert second.superseded_by is None and second.status == "ok"
    assert other_day.superseded_by is None
    assert ReconciliationRun.objects.filter(provider_key=key).count() == 3
    assert first.rows.count() == second.rows.count() == 1


# --- CSV -------------------------------------------------------------------------------------


def test_usd_is_converted_to_micro_dollars_exactly() -> None:
    assert usd_to_micros("0.012345") == 12_345
    assert usd_to_micros("1") == 1_000_000
    assert usd_to_micros(" 123456.789012 ") == 123_456_789_012
    assert usd_to_micros("0.1") + usd_to_micros("0.2") == usd_to_micros("0.3")
    assert usd_to_micros("0.0000005") == 1 and usd_to_micros("0.00000049") == 0
    for bad in ("-1", "NaN", "Infinity", "1,5", "$1"):
        with pytest.raises(ValueError):
            usd_to_micros(bad)


@pytest.mark.parametrize(("lines", "message"), [
    ([f"{DAY},k,gpt-4o,10,1,1,", f"{DAY},k,gpt-4o,ten,1,1,"],
     "line 3: input_tokens must be a non-negative integer, got 'ten'"),
    ([f"{DAY},k,gpt-4o,10,-1,1,"], "line 2: output_tokens must be a non-negative integer"),
    (["2026/11/20,k,gpt-4o,10,1,1,"], "line 2: day must be YYYY-MM-DD"),
    ([f"{DAY},k,,10,1,1,"], "line 2: model is empty"),
    ([f"{DAY},k,gpt-4o,10,1,1,1.2.3"], "line 2: not a decimal number"),
    ([f"{DAY},k,gpt-4o,10,1"], "line 2: 5 fields, the header has 7"),
])
def test_a_malformed_csv_line_is_named(tmp_path: Path, lines: list[str], message: str) -> None:
    bill = csv_bill(tmp_path, *lines)
    with pytest.raises(BillFormatError, match="bill.csv, " + message.replace("(", r"\(")):
        bill.fetch(DAY, DAY + timedelta(days=1))


def test_csv_header_and_file_objects(tmp_path: Path) -> None:
    path = tmp_path / "no-header.csv"
    path.write_text(f"{DAY},k,gpt-4o,10,1,1,\n")
    with pytest.raises(BillFormatError, match="line 1: missing column"):
        CsvBill(path).fetch(DAY, DAY + timedelta(days=1))
    with pytest.raises(BillFormatError, match="line 1: empty file"):
        CsvBill(StringIO("")).fetch(DAY, DAY + timedelta(days=1))
    with pytest.raises(BillError, match="cannot read"):
        CsvBill(tmp_path / "absent.csv").fetch(DAY, DAY + timedelta(days=1))
    # Columns in any order, cost_usd optional, extra columns ignored, a BOM, blank lines.
    text = ("\ufeffmodel,day,requests,api_key_id,output_tokens,input_tokens,project\n"
            f"gpt-4o,{DAY},3,k1,20,100,p\n\n")
    lines = CsvBill(StringIO(text)).fetch(DAY, DAY + timedelta(days=1))
    assert lines == [BillLine(DAY, "k1", "gpt-4o", 100, 20, 3, None)]
    assert CsvBill(text.encode()).__class__ is CsvBill
    import io
    assert CsvBill(io.BytesIO(text.encode())).fetch(DAY, DAY + timedelta(days=1)) == lines


def test_a_malformed_bill_makes_a_failed_run_and_alerts(key: ProviderKey, tmp_path: Path,
                                                        admins: None) -> None:
    usage(key, "gpt-4o", DAY, 100, 0)
    run = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,x,0,1,"), provider_key=key)
    assert run.status == "failed" and run.rows.count() == 0
    assert "bill.csv, line 2: input_tokens" in run.error
    assert "failed" in mail.outbox[0].subject and "line 2" in mail.outbox[0].body


# --- OpenAI usage API ------------------------------------------------------------------------


def _unix(day: date) -> int:
    return int(datetime.combine(day, time(), tzinfo=UTC).timestamp())


def _page(days: list[date], results: dict[date, list[dict[str, Any]]],
          next_page: str | None) -> dict[str, Any]:
    return {"object": "page", "has_more": next_page is not None, "next_page": next_page,
            "data": [{"object": "bucket", "start_time": _unix(d), "end_time": _unix(d) + 86400,
                      "results": results.get(d, [])} for d in days]}


def test_the_openai_adapter_follows_pages() -> None:
    d1, d2 = DAY, DAY + timedelta(days=1)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.headers["authorization"] == "Bearer sk-admin-test"
        endpoint = request.url.path.rsplit("/", 1)[-1]
        page = request.url.params.get("page")
        if endpoint == "embeddings":
            return httpx.Response(200, json=_page([d1, d2], {d2: [{
                "object": "organization.usage.embeddings.result", "input_tokens": 40,
                "num_model_requests": 2, "api_key_id": "key_A", "model": "text-embedding-3-small"
            }]}, None))
        if page is None:
            return httpx.Response(200, json=_page([d1], {d1: [
                {"input_tokens": 100, "output_tokens": 10, "num_model_requests": 1,
                 "api_key_id": "key_A", "model": "gpt-4o", "project_id": None},
                {"input_tokens": 5, "output_tokens": 1, "num_model_requests": 1,
                 "api_key_id": None, "model": "gpt-4o-mini"}]}, "page_2"))
        assert page == "page_2"
        return httpx.Response(200, json=_page([d2], {d2: [
            {"input_tokens": 200, "output_tokens": 20, "num_model_requests": 2,
             "api_key_id": "key_B", "model": "gpt-4o"}]}, None))

    api = OpenAIUsageAPI("https://api.openai.test/v1/", "sk-admin-test",
                         transport=httpx.MockTransport(handler))
    lines = api.fetch(d1, d2 + timedelta(days=1))
    assert lines == [
        BillLine(d1, "key_A", "gpt-4o", 100, 10, 1, None),
        BillLine(d1, "", "gpt-4o-mini", 5, 1, 1, None),
        BillLine(d2, "key_B", "gpt-4o", 200, 20, 2, None),
        BillLine(d2, "key_A", "text-embedding-3-small", 40, 0, 2, None),
    ]
    assert [r.url.path for r in seen] == ["/v1/organization/usage/completions"] * 2 + [
        "/v1/organization/usage/embeddings"]
    first = seen[0].url.params
    assert first.get_list("group_by") == ["api_key_id", "model"]
    assert (first["bucket_width"], first["start_time"], first["end_time"]) == (
        "1d", str(_unix(d1)), str(_unix(d2 + timedelta(days=1))))
    assert "page" not in first and seen[1].url.params["page"] == "page_2"

    api.fetch(d1, d2, api_key_ids={"key_B", "key_A"})
    assert seen[-1].url.params.get_list("api_key_ids") == ["key_A", "key_B"]


@pytest.mark.parametrize(("response", "message"), [
    (httpx.Response(401, json={"error": {"message": "bad admin key"}}), "answered 401"),
    (httpx.Response(200, text="<html>"), "not a usage page"),
    (httpx.Response(200, json={"data": [], "has_more": True, "next_page": None}),
     "has_more without a new next_page"),
    (httpx.Response(200, json={"data": [{"start_time": 0, "results": [
        {"input_tokens": -1}]}], "has_more": False}), "unexpected input_tokens"),
])
def test_the_openai_adapter_reports_bad_answers(response: httpx.Response, message: str) -> None:
    api = OpenAIUsageAPI("https://api.openai.test/v1", "sk-admin",
                         transport=httpx.MockTransport(lambda request: response))
    with pytest.raises(BillError, match=message):
        api.fetch(date(1970, 1, 1), date(1970, 1, 2))


def test_openai_key_ids_come_from_aliases_entered_by_an_operator(key: ProviderKey) -> None:
    usage(key, "gpt-4o", DAY, 100, 10)
    requested: list[list[str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requested.append(request.url.params.get_list("api_key_ids"))
        if request.url.path.endswith("embeddings"):
            return httpx.Response(200, json=_page([DAY], {}, None))
        return httpx.Response(200, json=_page([DAY], {DAY: [
            {"input_tokens": 100, "output_tokens": 10, "num_model_requests": 1,
             "api_key_id": "key_openai_123", "model": "gpt-4o"}]}, None))

    api = OpenAIUsageAPI("https://api.openai.test/v1", "sk-admin",
                         transport=httpx.MockTransport(handler))
    # No alias yet: OpenAI's ids cannot be derived, so nothing is asked and ours is unmatched.
    assert upstream_key_id_for(key, derive=False) is None
    [row] = reconcile(DAY, api, provider_key=key).rows.all()
    assert requested == [] and row.flagged
    assert row.note == "missing on their side; no upstream key alias (add one in the admin)"

    UpstreamKeyAlias.objects.create(provider_key=key, upstream_key_id="key_openai_123")
    assert upstream_key_id_for(key, derive=False) == "key_openai_123"
    run = reconcile(DAY, api, provider_key=key)
    assert run.status == "ok" and run.source == "openai_api"
    assert requested == [["key_openai_123"], ["key_openai_123"]]
    assert not UpstreamKeyAlias.objects.filter(derived=True).exists()


def test_an_unreachable_usage_api_makes_a_failed_run(key: ProviderKey) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    UpstreamKeyAlias.objects.create(provider_key=key, upstream_key_id="key_x")
    api = OpenAIUsageAPI("https://api.openai.test/v1", "sk-admin",
                         transport=httpx.MockTransport(handler))
    run = reconcile(DAY, api, provider_key=key)
    assert run.status == "failed" and "ConnectError: connection refused" in run.error


def test_mock_naming_is_derived_and_stored(key: ProviderKey) -> None:
    assert upstream_key_id_for(key) == KID == api_key_id(SECRET)
    alias = UpstreamKeyAlias.objects.get(provider_key=key)
    assert (alias.upstream_key_id, alias.derived) == (KID, True)
    assert upstream_key_id_for(key) == KID and UpstreamKeyAlias.objects.count() == 1


# --- the mock upstream's bill, the daily task and its lock -----------------------------------


@pytest.fixture
def mock_bill() -> Iterator[MockUpstream]:
    ledger.reset()
    with start_in_thread() as upstream:
        yield upstream
    ledger.reset()


@pytest.fixture
def mock_key(mock_bill: MockUpstream, acme: Tenant) -> ProviderKey:
    return create_provider_key("mock", base_url=mock_bill.base_url, secret="sk-mock-bill-test")


def _bill_yesterday(model: str, input_tokens: int, output_tokens: int) -> date:
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    noon = datetime.combine(yesterday, time(12), tzinfo=UTC).timestamp()
    ledger.record_completion(api_key_id("sk-mock-bill-test"), model, input_tokens,
                             output_tokens, now=noon)
    return yesterday


def test_the_mock_bill_matches_the_ledger(mock_key: ProviderKey, acme: Tenant) -> None:
    yesterday = _bill_yesterday("gpt-4o", 300, 30)
    ledger.record_embedding(api_key_id("sk-mock-bill-test"), "text-embedding-3-small", 12,
                            now=datetime.combine(yesterday, time(1), tzinfo=UTC).timestamp())
    usage(mock_key, "gpt-4o", yesterday, 300, 30, tenant=acme)
    usage(mock_key, "text-embedding-3-small", yesterday, 12, 0, tenant=acme)
    run = reconcile(yesterday, MockBill(mock_key.base_url), provider_key=mock_key)
    assert run.status == "ok" and run.source == "mock" and run.rows_count == 2
    assert (run.theirs_input_tokens, run.theirs_output_tokens) == (312, 30)


def test_the_daily_task_reconciles_yesterday_under_a_lock(
    mock_key: ProviderKey, acme: Tenant, settings: Any
) -> None:
    settings.TOLLGATE_RECONCILE_SOURCE = "mock"
    yesterday = _bill_yesterday("gpt-4o-mini", 1000, 100)
    usage(mock_key, "gpt-4o-mini", yesterday, 1000, 100, tenant=acme)
    disabled = create_provider_key("off", base_url=mock_key.base_url, secret="sk-disabled-0003",
                                   enabled=False)

    # Another worker is reconciling yesterday: this one skips it and stores nothing.
    client = get_engine().client
    with day_lock(yesterday, client=client):
        assert client.pttl(reconcile_lock_key(yesterday)) > 0
        with pytest.raises(DayLocked):
            with day_lock(yesterday, client=client):
                pass
        assert reconcile_daily() == {"day": yesterday.isoformat(), "skipped": "locked",
                                     "runs": []}
        assert not ReconciliationRun.objects.exists()
    assert client.get(reconcile_lock_key(yesterday)) is None  # released by its owner

    result = reconcile_daily()
    [run] = ReconciliationRun.objects.all()
    assert result == {"day": yesterday.isoformat(), "skipped": "",
                      "runs": [{"id": run.public_id, "status": "ok"}]}
    assert (run.provider_key, run.day, run.source) == (mock_key, yesterday, "mock")
    assert run.provider_key != disabled and client.get(reconcile_lock_key(yesterday)) is None

    # An explicit day, e.g. a backfill: the mock has nothing for it, ours neither.
    earlier = (yesterday - timedelta(days=3)).isoformat()
    assert reconcile_daily(earlier)["runs"][0]["status"] == "ok"


def test_an_expired_lock_is_not_released_by_its_former_owner() -> None:
    client = get_engine().client
    day = date(2001, 1, 1)
    with day_lock(day, client=client, ttl_seconds=0.05):
        import time as clock
        clock.sleep(0.1)  # expired: a second worker takes the day over
        with day_lock(day, client=client, ttl_seconds=10):
            pass
        client.set(reconcile_lock_key(day), "someone-else", px=10_000)
    assert client.get(reconcile_lock_key(day)) == "someone-else"
    client.delete(reconcile_lock_key(day))


def test_the_daily_task_is_disabled_without_a_source(settings: Any) -> None:
    settings.TOLLGATE_RECONCILE_SOURCE = ""
    assert reconcile_daily("2026-11-01") == {"day": "2026-11-01", "skipped": "disabled",
                                             "runs": []}


def test_openai_source_without_an_admin_key_fails_visibly(key: ProviderKey, settings: Any,
                                                          monkeypatch: Any) -> None:
    settings.TOLLGATE_RECONCILE_SOURCE = "openai"
    settings.TOLLGATE_OPENAI_USAGE_BASE_URL = "https://upstream.test/v1"
    settings.TOLLGATE_OPENAI_ADMIN_KEY_ENV = "TOLLGATE_TEST_OPENAI_ADMIN_KEY"
    monkeypatch.delenv("TOLLGATE_TEST_OPENAI_ADMIN_KEY", raising=False)
    create_provider_key("elsewhere", base_url="https://other.test/v1", secret="sk-other-0004")
    result = reconcile_daily("2026-11-01")
    [run] = ReconciliationRun.objects.all()  # only the key on the usage API's host
    assert run.provider_key == key and run.status == "failed"
    assert "TOLLGATE_TEST_OPENAI_ADMIN_KEY is not set" in run.error
    assert result["runs"] == [{"id": run.public_id, "status": "failed"}]


# --- the management command ------------------------------------------------------------------


def test_the_command_imports_a_csv_bill(key: ProviderKey, tmp_path: Path) -> None:
    usage(key, "gpt-4o", DAY, 1000, 0)
    path = tmp_path / "bill.csv"
    path.write_text(HEADER + f"{DAY},{KID},gpt-4o,1070,0,3,0.5\n")
    out = StringIO()
    call_command("reconcile", "--day", DAY.isoformat(), "--source", "csv", "--csv", str(path),
                 "--json", stdout=out)
    [run] = json.loads(out.getvalue())
    assert (run["status"], run["source"], run["provider_key"]) == ("drift", "csv", None)
    [row] = run["rows"]
    assert row["flagged"] and row["provider_key"] == key.public_id
    assert row["theirs"] == [1070, 0, 500_000] and row["difference"] == 70

    out = StringIO()
    call_command("reconcile", "--day", DAY.isoformat(), "--source", "csv", "--csv", str(path),
                 "--tolerance", "0.1", "--provider-key", key.public_id, stdout=out)
    assert "OK (0 of 1 rows flagged, tolerance 0.100000)" in out.getvalue()
    assert ReconciliationRun.objects.filter(superseded_by__isnull=True).count() == 2

    path.write_text(HEADER + f"{DAY},{KID},gpt-4o,1070,0,3,abc\n")
    with pytest.raises(CommandError, match="1 run\\(s\\) failed: .*line 2: not a decimal"):
        call_command("reconcile", "--day", DAY.isoformat(), "--source", "csv", "--csv",
                     str(path), stdout=StringIO())
    with pytest.raises(CommandError, match="--csv FILE goes with --source csv"):
        call_command("reconcile", "--day", DAY.isoformat(), "--source", "csv")
    with pytest.raises(CommandError, match="--day must be YYYY-MM-DD"):
        call_command("reconcile", "--day", "yesterday", "--source", "mock")


# --- admin -----------------------------------------------------------------------------------


def test_operators_see_runs_and_rows_in_the_admin(admin_client: Any, key: ProviderKey,
                                                  tmp_path: Path) -> None:
    usage(key, "gpt-4o", DAY, 1000, 0)
    first = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,1070,0,1,"), provider_key=key)
    reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,1000,0,1,"), provider_key=key)
    listing = admin_client.get("/admin/billing/reconciliationrun/")
    assert listing.status_code == 200 and first.public_id.encode() in listing.content
    page = admin_client.get(f"/admin/billing/reconciliationrun/{first.pk}/change/")
    assert page.status_code == 200
    assert b"missing on" not in page.content and b"gpt-4o" in page.content
    for url in ("/admin/billing/reconciliationrow/", "/admin/billing/usagerecord/",
                "/admin/gateway/modelprice/", "/admin/billing/upstreamkeyalias/",
                "/admin/billing/upstreamkeyalias/add/", "/admin/gateway/modelprice/add/"):
        assert admin_client.get(url).status_code == 200, url
    record = UsageRecord.objects.first()
    assert admin_client.get(f"/admin/billing/usagerecord/{record.pk}/change/").status_code == 200
    # The ledger is read-only, even for a superuser.
    assert admin_client.get("/admin/billing/usagerecord/add/").status_code == 403
    response = admin_client.post("/admin/billing/upstreamkeyalias/add/", {
        "provider_key": key.pk, "upstream_key_id": "key_from_openai"})
    assert response.status_code == 302
    assert UpstreamKeyAlias.objects.get(upstream_key_id="key_from_openai").derived is False


def test_admin_alias_edits_and_run_pruning_are_audited(admin_client: Any, admin_user: Any,
                                                       key: ProviderKey, tmp_path: Path) -> None:
    from tenants.models import AuditEvent

    actor = f"user:{admin_user.username}"
    assert admin_client.post("/admin/billing/upstreamkeyalias/add/", {
        "provider_key": key.pk, "upstream_key_id": "key_entered"}).status_code == 302
    alias = UpstreamKeyAlias.objects.get(upstream_key_id="key_entered")
    assert admin_client.post(f"/admin/billing/upstreamkeyalias/{alias.pk}/delete/",
                             {"post": "yes"}).status_code == 302
    usage(key, "gpt-4o", DAY, 1000, 0)
    run = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},gpt-4o,1000,0,1,"), provider_key=key)
    assert admin_client.post(f"/admin/billing/reconciliationrun/{run.pk}/delete/",
                             {"post": "yes"}).status_code == 302
    events = list(AuditEvent.objects.filter(actor=actor).order_by("id")
                  .values_list("action", "target"))
    assert events == [("upstream_key_alias.create", "key_entered"),
                      ("upstream_key_alias.delete", "key_entered"),
                      ("reconciliation_run.delete", run.public_id)]
    assert not ReconciliationRun.objects.filter(pk=run.pk).exists()


# --- token classes ---------------------------------------------------------------------------

CLASS_HEADER = ("day,api_key_id,model,input_tokens,output_tokens,requests,cost_usd,"
                "input_cached_tokens,input_cache_write_tokens,output_reasoning_tokens\n")


def classed_usage(key: ProviderKey, model: str, day: date, input_tokens: int,
                  output_tokens: int, cached: int = 0, write: int = 0,
                  reasoning: int = 0) -> UsageRecord:
    row = usage(key, model, day, input_tokens, output_tokens)
    row.cached_input_tokens, row.cache_write_tokens, row.reasoning_tokens = (cached, write,
                                                                             reasoning)
    row.save(update_fields=["cached_input_tokens", "cache_write_tokens", "reasoning_tokens"])
    return row


def classed_bill(tmp_path: Path, *lines: str) -> CsvBill:
    path = tmp_path / "classes.csv"
    path.write_text(CLASS_HEADER + "".join(f"{line}\n" for line in lines))
    return CsvBill(path)


def test_token_classes_that_agree_pass_and_a_wrong_split_is_flagged(
    key: ProviderKey, tmp_path: Path, admins: None
) -> None:
    d2 = DAY + timedelta(days=1)
    classed_usage(key, "claude-sonnet-4-5", DAY, 10_000, 1_000, 6_000, 2_000, 400)
    classed_usage(key, "gpt-4o", DAY, 1_000, 100, cached=512)
    # The same totals as the bill, but the gateway recorded no cache read: a class mismatch.
    classed_usage(key, "gpt-4o", d2, 1_000, 100)
    bill = classed_bill(tmp_path,
                        f"{DAY},{KID},claude-sonnet-4-5,10000,1000,1,,6000,2000,400",
                        f"{DAY},{KID},gpt-4o,1000,100,1,,512,0,0",
                        f"{d2},{KID},gpt-4o,1000,100,1,,512,0,0")
    run = reconcile((DAY, d2 + timedelta(days=1)), bill, provider_key=key)
    rows = rows_by_model(run)
    claude = rows[(DAY, "claude-sonnet-4-5")]
    assert not claude.flagged and claude.note == ""
    assert (claude.ours_cached_input, claude.ours_cache_write, claude.ours_reasoning) == (
        6_000, 2_000, 400)
    assert (claude.theirs_cached_input, claude.theirs_cache_write, claude.theirs_reasoning) == (
        6_000, 2_000, 400)
    # The bill's usage at our prices: 2,000 plain input at $3, 6,000 reads at $0.30, 2,000
    # writes at $3.75, 1,000 output at $15 (Price.cost_of of the line's usage).
    assert claude.theirs_priced_micros == 6_000 + 1_800 + 7_500 + 15_000
    assert claude.theirs_cost_micros is None  # the bill itself gave none
    assert not rows[(DAY, "gpt-4o")].flagged
    # gpt-4o: 488 plain at $2.50, 512 cached at $1.25, 100 output at $10: 1,220 + 640 + 1,000.
    assert rows[(DAY, "gpt-4o")].theirs_priced_micros == 2_860

    wrong = rows[(d2, "gpt-4o")]
    assert wrong.difference == 0 and wrong.difference_rate == 0
    assert wrong.flagged and wrong.note == "cached input differs: ours 0, theirs 512"
    assert run.status == "drift" and run.flagged_count == 1
    assert "cached input differs: ours 0, theirs 512" in mail.outbox[0].body


def test_a_class_within_the_tolerance_passes(key: ProviderKey, tmp_path: Path) -> None:
    classed_usage(key, "o3-mini", DAY, 1_000, 2_000, reasoning=1_000)
    classed_usage(key, "gpt-4o-mini", DAY, 1_000, 2_000, reasoning=1_000)
    bill = classed_bill(tmp_path, f"{DAY},{KID},o3-mini,1000,2000,1,,0,0,1050",   # 4.8%
                        f"{DAY},{KID},gpt-4o-mini,1000,2000,1,,0,0,1060")         # 5.7%
    rows = rows_by_model(reconcile(DAY, bill, provider_key=key))
    assert not rows[(DAY, "o3-mini")].flagged
    assert rows[(DAY, "gpt-4o-mini")].flagged
    assert rows[(DAY, "gpt-4o-mini")].note == "reasoning differs: ours 1000, theirs 1060"


def test_classes_a_bill_does_not_report_are_not_compared(key: ProviderKey,
                                                         tmp_path: Path) -> None:
    classed_usage(key, "o3-mini", DAY, 1_000, 2_000, cached=300, reasoning=1_500)
    # A bill without the class columns (or with empty cells): nothing to compare the split to.
    run = reconcile(DAY, csv_bill(tmp_path, f"{DAY},{KID},o3-mini,1000,2000,1,"),
                    provider_key=key)
    [row] = run.rows.all()
    assert run.status == "ok" and not row.flagged
    assert (row.ours_cached_input, row.ours_reasoning) == (300, 1_500)
    assert (row.theirs_cached_input, row.theirs_cache_write, row.theirs_reasoning) == (
        None, None, None)
    # Priced as if nothing were cached: 1,000 input at $1.10, 2,000 output at $4.40.
    assert row.theirs_priced_micros == 1_100 + 8_800
    run = reconcile(DAY, classed_bill(tmp_path, f"{DAY},{KID},o3-mini,1000,2000,1,,300,,"),
                    provider_key=key)
    [row] = run.rows.all()
    assert (row.theirs_cached_input, row.theirs_cache_write, row.theirs_reasoning) == (
        300, None, None)
    assert not row.flagged


def test_a_bill_line_without_a_price_has_no_priced_figure(key: ProviderKey,
                                                          tmp_path: Path) -> None:
    bill = classed_bill(tmp_path, f"{DAY},{KID},mystery-model,70,7,1,,,,")
    [row] = reconcile(DAY, bill, provider_key=key).rows.all()
    assert row.flagged and row.theirs_priced_micros is None


def test_csv_class_cells_are_checked(tmp_path: Path) -> None:
    bill = classed_bill(tmp_path, f"{DAY},k,gpt-4o,10,1,1,,x,,")
    with pytest.raises(BillFormatError,
                       match="line 2: input_cached_tokens must be a non-negative integer"):
        bill.fetch(DAY, DAY + timedelta(days=1))
    [line] = classed_bill(tmp_path, f"{DAY},k,gpt-4o,10,1,1,,4,,1").fetch(
        DAY, DAY + timedelta(days=1))
    assert (line.cached_input_tokens, line.cache_write_tokens, line.reasoning_tokens) == (
        4, None, 1)


def test_the_openai_adapter_reads_the_classes_it_is_given() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("embeddings"):
            return httpx.Response(200, json=_page([DAY], {}, None))
        return httpx.Response(200, json=_page([DAY], {DAY: [
            # OpenAI's own result: cached input, no reasoning figure.
            {"input_tokens": 100, "output_tokens": 10, "input_cached_tokens": 64,
             "input_audio_tokens": 0, "num_model_requests": 1, "api_key_id": "key_A",
             "model": "gpt-4o"},
            {"input_tokens": 50, "output_tokens": 5, "input_cached_tokens": None,
             "num_model_requests": 1, "api_key_id": "key_A", "model": "gpt-4o-mini"}]}, None))

    api = OpenAIUsageAPI("https://api.openai.test/v1", "sk-admin",
                         transport=httpx.MockTransport(handler))
    assert api.fetch(DAY, DAY + timedelta(days=1)) == [
        BillLine(DAY, "key_A", "gpt-4o", 100, 10, 1, None, cached_input_tokens=64),
        BillLine(DAY, "key_A", "gpt-4o-mini", 50, 5, 1, None),
    ]


def test_the_mock_bill_matches_the_ledger_class_by_class(mock_key: ProviderKey,
                                                        acme: Tenant) -> None:
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    noon = datetime.combine(yesterday, time(12), tzinfo=UTC).timestamp()
    kid = api_key_id("sk-mock-bill-test")
    ledger.record_completion(kid, "claude-haiku-4-5", 5_000, 800, now=noon, cached=3_000,
                             cache_write=1_000, reasoning=200)
    ledger.record_completion(kid, "gpt-4o", 900, 90, now=noon, cached=256)
    for model, inp, out, cached, write, reasoning in (
            ("claude-haiku-4-5", 5_000, 800, 3_000, 1_000, 200),
            ("gpt-4o", 900, 90, 128, 0, 0)):  # half of gpt-4o's cache reads are missing here
        row = usage(mock_key, model, yesterday, inp, out, tenant=acme)
        UsageRecord.objects.filter(pk=row.pk).update(
            cached_input_tokens=cached, cache_write_tokens=write, reasoning_tokens=reasoning)
    run = reconcile(yesterday, MockBill(mock_key.base_url), provider_key=mock_key)
    rows = rows_by_model(run)
    haiku = rows[(yesterday, "claude-haiku-4-5")]
    assert not haiku.flagged
    assert (haiku.theirs_cached_input, haiku.theirs_cache_write, haiku.theirs_reasoning) == (
        3_000, 1_000, 200)
    # 1,000 plain at $1, 3,000 reads at $0.10, 1,000 writes at $1.25, 800 output at $5.
    assert haiku.theirs_priced_micros == 1_000 + 300 + 1_250 + 4_000
    gpt = rows[(yesterday, "gpt-4o")]
    assert gpt.flagged and gpt.note == "cached input differs: ours 128, theirs 256"
    assert run.status == "drift"


def test_swept_rows_leave_the_classes_uncompared_with_a_note(key: ProviderKey,
                                                             tmp_path: Path) -> None:
    """A swept row carries the sweep's estimate and no class split: its group's totals are
    compared, its classes are not (the bill's cache reads are not a mismatch), and the note says
    why. A group without swept rows is compared as before."""
    d2 = DAY + timedelta(days=1)
    classed_usage(key, "gpt-4o", DAY, 600, 60, cached=300)
    usage(key, "gpt-4o", DAY, 400, 40, status="swept", sweep_basis="streaming")
    classed_usage(key, "gpt-4o", d2, 1_000, 100)  # no swept row: a wrong split is flagged
    bill = classed_bill(tmp_path, f"{DAY},{KID},gpt-4o,1000,100,2,,500,0,0",
                        f"{d2},{KID},gpt-4o,1000,100,1,,500,0,0")
    run = reconcile((DAY, d2 + timedelta(days=1)), bill, provider_key=key)
    rows = rows_by_model(run)
    swept = rows[(DAY, "gpt-4o")]
    assert (swept.ours_input, swept.ours_output, swept.ours_requests) == (1_000, 100, 2)
    assert swept.ours_cached_input == 300 and swept.theirs_cached_input == 500
    assert not swept.flagged
    assert swept.note == "token classes not compared: swept rows carry no class split"
    compared = rows[(d2, "gpt-4o")]
    assert compared.flagged and compared.note == "cached input differs: ours 0, theirs 500"
    # A swept row corrected by a late settle (status settled, corrected_at set) is compared.
    UsageRecord.objects.filter(status="swept").update(
        status="settled", corrected_at=datetime.combine(DAY, time(13), tzinfo=UTC))
    [row] = reconcile(DAY, bill, provider_key=key).rows.all()
    assert row.flagged and row.note == "cached input differs: ours 300, theirs 500"


def test_a_bill_line_is_priced_by_the_defaults_of_its_keys_kind(acme: Tenant,
                                                                  tmp_path: Path) -> None:
    """A model without a price of its own, on the bill of an anthropic-kind key, costs that
    kind's default price, never the openai-kind key's (and the other way round)."""
    from gateway.prices import Price

    openai_key = create_provider_key("cheap", base_url="https://a.test/v1",
                                     secret="sk-kinds-reconcile-01", tenant=acme,
                                     default_price=Price(1_000_000, 2_000_000))
    claude_key = create_provider_key("claude", base_url="https://b.test/v1",
                                     secret="sk-kinds-reconcile-02", tenant=acme,
                                     kind="anthropic", default_price=Price(3_000_000, 15_000_000))
    ProviderKey.objects.exclude(pk__in=(openai_key.pk, claude_key.pk)).update(enabled=False)
    for provider_key in (openai_key, claude_key):
        usage(provider_key, "mystery-model", DAY, 1_000, 100)
    bill = csv_bill(tmp_path, *(f"{DAY},{kid},mystery-model,1000,100,1," for kid in (
        api_key_id("sk-kinds-reconcile-01"), api_key_id("sk-kinds-reconcile-02"), "key_not_ours")))
    run = reconcile(DAY, bill)
    priced = {row.provider_key_id: row.theirs_priced_micros for row in run.rows.all()}
    assert priced[openai_key.pk] == 1_000 + 200
    assert priced[claude_key.pk] == 3_000 + 1_500
    # A key that is none of ours has no kind: only a model's own price would apply.
    assert priced[None] is None
