"""The log formats (config/log_format.py) and their settings: JSON lines with the request's
public ids and the access fields, the plain format's ids in brackets, secrets masked, bad values
refused at start, uvicorn's and the access logger's lines through the same handler."""
from __future__ import annotations

import asyncio
import base64
import contextvars
import io
import json
import logging
import logging.config
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from config.log_format import MASK, JsonFormatter, PlainFormatter, scrub, utc_time
from gateway import access_log, request_context, tokens
from gateway.runtime import Database
from tenants.api_key_format import generate_key

ROOT = Path(__file__).resolve().parent.parent
ISO_MS_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.fixture
def capture() -> Iterator[Callable[..., io.StringIO]]:
    """capture(formatter, name="tollgate.test"): that logger's lines in that format, in a buffer
    (only there: it does not propagate while the test runs)."""
    saved: list[tuple[logging.Logger, logging.Handler, int, bool]] = []

    def attach(formatter: logging.Formatter, name: str = "tollgate.test",
               buffer: io.StringIO | None = None) -> io.StringIO:
        logger = logging.getLogger(name)
        buffer = buffer if buffer is not None else io.StringIO()
        handler = logging.StreamHandler(buffer)
        handler.setFormatter(formatter)
        saved.append((logger, handler, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        return buffer

    yield attach
    for logger, handler, level, propagate in reversed(saved):
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def in_request(work: Callable[[], Any], rid: str = "req_abc", tenant: str | None = "ten_T",
               key: str | None = "key_K") -> Any:
    """Run `work` in a context of its own bound like a request's (nothing leaks to the test)."""
    def run() -> Any:
        request_context.bind_request(rid)
        if tenant is not None and key is not None:
            request_context.bind_caller(tenant, key)
        return work()

    return contextvars.copy_context().run(run)


def lines(buffer: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_json_line_outside_a_request(capture: Callable[..., io.StringIO]) -> None:
    buffer = capture(JsonFormatter())
    before = time.time()
    logging.getLogger("tollgate.test").warning("swept %d holds of %s", 3, "ten_x")
    [line] = lines(buffer)
    assert set(line) == {"time", "level", "logger", "message"}
    assert (line["level"], line["logger"], line["message"]) == (
        "WARNING", "tollgate.test", "swept 3 holds of ten_x")
    assert ISO_MS_UTC.fullmatch(line["time"])
    stamp = datetime.strptime(line["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    assert before - 0.002 <= stamp.timestamp() <= time.time()


def test_utc_time_is_utc_with_milliseconds() -> None:
    assert utc_time(0.0, 0.0) == "1970-01-01T00:00:00.000Z"
    # 2026-03-01 12:34:56.789 UTC, whatever the machine's zone.
    created = datetime(2026, 3, 1, 12, 34, 56, tzinfo=timezone.utc).timestamp() + 0.789
    assert utc_time(created, 789.0) == "2026-03-01T12:34:56.789Z"
    # The same second again (its text is kept), then the next one.
    assert utc_time(created + 0.1, 889.0) == "2026-03-01T12:34:56.889Z"
    assert utc_time(created + 0.3, 89.0) == "2026-03-01T12:34:57.089Z"


def test_a_json_line_inside_a_request_has_its_public_ids(
        capture: Callable[..., io.StringIO]) -> None:
    buffer = capture(JsonFormatter())
    log = logging.getLogger("tollgate.test")
    in_request(lambda: log.error("hold of %s ended", "req_abc"))
    # Before the key is known (a refusal for a bad key): only the request id.
    in_request(lambda: log.info("no key"), rid="req_nokey", tenant=None, key=None)
    first, second = lines(buffer)
    assert (first["request_id"], first["tenant"], first["api_key"]) == (
        "req_abc", "ten_T", "key_K")
    assert first["message"] == "hold of req_abc ended"
    assert second["request_id"] == "req_nokey"
    assert "tenant" not in second and "api_key" not in second


def test_work_handed_to_a_thread_logs_with_the_requests_ids(
        capture: Callable[..., io.StringIO]) -> None:
    """A large body's counting (gateway.tokens.off_loop) and the database threads
    (gateway.runtime.Database: a rebuild of lost counters) run in a copy of the request's
    context: their lines carry its ids, and what they bind stays on their side."""
    buffer = capture(JsonFormatter())
    log = logging.getLogger("tollgate.test")
    threads: list[str] = []

    def work(n: int) -> int:
        threads.append(threading.current_thread().name)
        log.warning("counted %d", n)
        request_context.bind_request("req_inner")  # in the copy only
        return n + 1

    async def call() -> tuple[int, int, str | None]:
        database = Database(1)
        counted = await tokens.off_loop(work, 1)
        read = await database.run(work, 2)
        return counted, read, request_context.request_id.get()

    assert in_request(lambda: asyncio.run(call())) == (2, 3, "req_abc")
    # Outside a request (the worker's own tasks), nothing to carry.
    asyncio.run(tokens.off_loop(work, 3))
    first, second, third = lines(buffer)
    assert threads[0].startswith("tollgate-estimate") and threads[1].startswith("gateway-db")
    for line, message in ((first, "counted 1"), (second, "counted 2")):
        assert (line["request_id"], line["tenant"], line["api_key"], line["message"]) == (
            "req_abc", "ten_T", "key_K", message)
    assert third["message"] == "counted 3"
    assert not {"request_id", "tenant", "api_key"} & set(third)


def test_the_access_line_carries_its_fields(capture: Callable[..., io.StringIO]) -> None:
    buffer = capture(JsonFormatter(), "tollgate.access")
    in_request(lambda: access_log.log_request(
        endpoint="chat.completions", model="gpt-4o", status=200, refusal="",
        duration_ms=12.34567, upstream_ms=10.0001, input_tokens=9, output_tokens=16,
        cost_micros=41, stream=True))
    in_request(lambda: access_log.log_request(
        endpoint="chat.completions", model="gpt-4o", status=429, refusal="quota_tenant",
        duration_ms=0.5, upstream_ms=None, input_tokens=0, output_tokens=0,
        cost_micros=0, stream=False), rid="req_refused")
    served, refused = lines(buffer)
    assert served == {
        "time": served["time"], "level": "INFO", "logger": "tollgate.access",
        "message": "chat.completions 200 gpt-4o 12.3 ms stream",
        "request_id": "req_abc", "tenant": "ten_T", "api_key": "key_K",
        "endpoint": "chat.completions", "model": "gpt-4o", "status": 200, "refusal": "",
        "duration_ms": 12.346, "upstream_ms": 10.0, "input_tokens": 9, "output_tokens": 16,
        "cost_micros": 41, "stream": True}
    assert refused["message"] == "chat.completions 429 gpt-4o 0.5 ms refused: quota_tenant"
    assert (refused["request_id"], refused["status"], refused["refusal"],
            refused["upstream_ms"]) == ("req_refused", 429, "quota_tenant", None)


def test_the_access_switch_follows_the_format_by_default(settings: Any) -> None:
    settings.TOLLGATE_ACCESS_LOG = True
    assert access_log.enabled()
    settings.TOLLGATE_ACCESS_LOG = False
    assert not access_log.enabled()


def test_the_access_switch_is_read_once_not_per_call(
        settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every /v1 call asks; a read of Django's settings costs about a microsecond, so the
    switch is read once, and again only when the setting changes (setting_changed)."""
    settings.TOLLGATE_ACCESS_LOG = True
    assert access_log.enabled()

    class Unreadable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"settings.{name} read on a call")

    monkeypatch.setattr(access_log, "settings", Unreadable())
    assert all(access_log.enabled() for _ in range(3))


def test_exceptions_and_other_extras(capture: Callable[..., io.StringIO]) -> None:
    buffer = capture(JsonFormatter())
    log = logging.getLogger("tollgate.test")
    try:
        raise RuntimeError("the settle failed")
    except RuntimeError:
        # An extra that is not the access dict is not written: only the listed fields are.
        log.exception("ending the hold of %s failed", "req_x", extra={"body": "a prompt"})
    log.warning("a Decimal is not JSON: %s", "ok", extra={"access": {
        "endpoint": "x", "cost": __import__("decimal").Decimal("1.5")}})
    failed, decimal = lines(buffer)
    assert failed["message"] == "ending the hold of req_x failed"
    assert failed["exception"].startswith("Traceback (most recent call last):")
    assert failed["exception"].endswith("RuntimeError: the settle failed")
    assert "body" not in failed and "a prompt" not in buffer.getvalue()
    assert decimal["cost"] == "1.5"


def test_one_line_per_record_even_with_newlines(capture: Callable[..., io.StringIO]) -> None:
    buffer = capture(JsonFormatter())
    logging.getLogger("tollgate.test").warning("two\nlines %r", "and\r\nmore")
    [line] = lines(buffer)
    assert line["message"] == "two\nlines 'and\\r\\nmore'"


def test_the_plain_format_shows_the_request_ids(capture: Callable[..., io.StringIO]) -> None:
    buffer = capture(PlainFormatter())
    log = logging.getLogger("tollgate.test")
    log.warning("outside")
    in_request(lambda: log.warning("inside"))
    in_request(lambda: log.warning("no key yet"), rid="req_2", tenant=None, key=None)
    outside, inside, no_key = buffer.getvalue().splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING tollgate.test outside",
                        outside)
    assert inside.endswith(" WARNING tollgate.test [req_abc ten_T key_K] inside")
    assert no_key.endswith(" WARNING tollgate.test [req_2] no key yet")


def test_secrets_are_masked_in_both_formats(capture: Callable[..., io.StringIO]) -> None:
    json_buffer = capture(JsonFormatter())
    plain_buffer = capture(PlainFormatter())
    log = logging.getLogger("tollgate.test")
    key = generate_key()[0]
    secret_part = key.rsplit("_", 1)[1]
    try:
        raise ValueError(f"GET https://admin:hunter2@bill.example/v1 with {key}")
    except ValueError:
        log.exception("Authorization: Bearer %s; provider sk-proj-Abc123def456ghi; token %s",
                      key, "tgm_AbC123xYz987_" + "z" * 40)
    for text in (json_buffer.getvalue(), plain_buffer.getvalue()):
        assert secret_part not in text and "hunter2" not in text
        assert "Abc123def456ghi" not in text and "z" * 40 not in text
    [line] = lines(json_buffer)
    assert line["message"] == (f"Authorization: Bearer {MASK}; provider sk-{MASK}; token "
                               f"tgm_AbC123xYz987_{MASK}")
    # The key's public lookup prefix stays: it says which key, as the console's masked form does.
    assert line["exception"].endswith(
        f"ValueError: GET https://{MASK}@bill.example/v1 with {key.rsplit('_', 1)[0]}_{MASK}")


def test_webhook_signing_secrets_are_masked_in_both_alphabets() -> None:
    # A new secret (standard base64, padded) and one from before Standard Webhooks (URL-safe,
    # unpadded): nothing of either survives, the `whsec_` that says what it was stays.
    standard = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    legacy = "whsec_" + secrets.token_urlsafe(32)
    masked = scrub(f"secret={standard}; old {legacy}.")
    assert masked == f"secret=whsec_{MASK}; old whsec_{MASK}."
    for secret in (standard, legacy):
        assert secret.removeprefix("whsec_")[:8] not in masked
    # The word alone (documentation, an error naming the format) is left as it is.
    text = "a webhook secret is whsec_ followed by base64"
    assert scrub(text) == text


def test_scrub_leaves_ordinary_text_alone() -> None:
    text = ("provider key pk_abc123 answered HTTP 500 for task-1234567890 on disk-abcdefghij at "
            "https://api.example.com:443/v1 (user a@b.example); redis://host:6379/0")
    assert scrub(text) == text


def test_uvicorn_and_the_access_logger_go_through_the_console_handler() -> None:
    """In a gateway worker uvicorn configures its loggers first (its own handlers), then Django
    applies settings.LOGGING: uvicorn's lines then use Tollgate's format, at uvicorn's level, and
    the access logger writes at INFO whatever the root level."""
    import uvicorn

    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "tollgate.access")
    saved = {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = (logger.handlers[:], logger.level, logger.propagate, logger.disabled)
    buffer = io.StringIO()
    try:
        uvicorn.Config("config.asgi:application", log_level="warning").configure_logging()
        config = json.loads(json.dumps(settings.LOGGING))
        config["handlers"]["console"]["formatter"] = "json"
        config["handlers"]["console"]["stream"] = buffer
        config["root"]["level"] = "WARNING"
        logging.config.dictConfig(config)
        logging.getLogger("uvicorn.error").info("Started server process [1]")  # below warning
        logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
        logging.getLogger("tollgate.access").info("chat.completions 200 gpt-4o")
        logging.getLogger("tollgate.other").info("dropped: below the root's level")
    finally:
        for name, (handlers, level, propagate, disabled) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate, logger.disabled = propagate, disabled
    found = [(line["logger"], line["message"]) for line in lines(buffer)]
    assert found == [("uvicorn.error", "Invalid HTTP request received."),
                     ("tollgate.access", "chat.completions 200 gpt-4o")]


def load_settings(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", f"import config.settings as s; {code}"],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("env", "expected"), [
    ({}, ["plain", "False"]),
    ({"TOLLGATE_LOG_FORMAT": "json"}, ["json", "True"]),
    ({"TOLLGATE_LOG_FORMAT": "JSON", "TOLLGATE_ACCESS_LOG": "off"}, ["json", "False"]),
    ({"TOLLGATE_LOG_FORMAT": "plain", "TOLLGATE_ACCESS_LOG": "true"}, ["plain", "True"]),
])
def test_format_and_access_settings(env: dict[str, str], expected: list[str]) -> None:
    base = {k: v for k, v in os.environ.items()
            if k not in ("TOLLGATE_LOG_FORMAT", "TOLLGATE_ACCESS_LOG")}
    result = subprocess.run(
        [sys.executable, "-c", "import config.settings as s; print(s.TOLLGATE_LOG_FORMAT, "
         "s.TOLLGATE_ACCESS_LOG, s.LOGGING['handlers']['console']['formatter'])"],
        cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [*expected, expected[0]]


@pytest.mark.parametrize(("env", "message"), [
    ({"TOLLGATE_LOG_FORMAT": "xml"}, "TOLLGATE_LOG_FORMAT must be plain or json, got 'xml'"),
    ({"TOLLGATE_LOG_FORMAT": "json", "TOLLGATE_ACCESS_LOG": "sometimes"},
     "TOLLGATE_ACCESS_LOG must be true or false"),
])
def test_bad_log_settings_stop_startup(env: dict[str, str], message: str) -> None:
    result = load_settings("print('loaded')", **env)
    assert result.returncode != 0 and "loaded" not in result.stdout
    assert message in result.stderr


@pytest.mark.parametrize("name", ["REDIS_URL", "CACHE_REDIS_URL"])
def test_a_bad_redis_url_is_named_without_its_password(name: str) -> None:
    result = load_settings("print('loaded')", **{name: "http://:hunter2@redis.example:6379/0"})
    assert result.returncode != 0
    assert f"{name} must be redis://, rediss:// or unix://, got http:" in result.stderr
    assert "hunter2" not in result.stderr


def test_uvicorns_supervisor_writes_json_with_the_shipped_log_config(tmp_path: Path) -> None:
    """The workers load settings.LOGGING; uvicorn's supervisor process never does. Given
    config/uvicorn_log_json.json (--log-config), its own lines are JSON lines too."""
    import signal

    (tmp_path / "tel_dummy_app.py").write_text("async def app(scope, receive, send):\n"
                                               "    pass\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tel_dummy_app:app", "--port", "0", "--workers", "2",
         "--lifespan", "off", "--log-level", "info",
         "--log-config", str(ROOT / "config" / "uvicorn_log_json.json")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = []
        assert process.stdout is not None
        for line in process.stdout:
            started.append(json.loads(line))
            if sum("Started server process" in x["message"] for x in started) == 2:
                break
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    found = started + [json.loads(line) for line in rest.splitlines()]
    messages = [line["message"] for line in found]
    assert any(m.startswith("Started parent process") for m in messages), messages
    assert any(m.startswith("Stopping parent process") for m in messages), messages
    assert {line["logger"] for line in found} == {"uvicorn.error"}
    assert all(ISO_MS_UTC.fullmatch(line["time"]) for line in found)
