"""Settings come from the environment and a malformed value stops startup with a clear message."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_settings(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import config.settings as s; print(s.QUOTA_STALE_HOLD_SECONDS)"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )


def test_good_environment_loads() -> None:
    result = load_settings(QUOTA_STALE_HOLD_SECONDS="900")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "900"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"QUOTA_STALE_HOLD_SECONDS": "ten"}, "invalid literal"),
        ({"QUOTA_STALE_HOLD_SECONDS": "0"}, "QUOTA_STALE_HOLD_SECONDS must be a positive integer"),
        ({"REDIS_URL": "ftp://example"}, "REDIS_URL must be"),
        ({"DATABASE_URL": "sqlite:///x.db"}, "DATABASE_URL must point at PostgreSQL"),
        ({"REDIS_CLUSTER": "maybe"}, "REDIS_CLUSTER must be true or false"),
        ({"REDIS_SOCKET_TIMEOUT": "-1"}, "REDIS_SOCKET_TIMEOUT must be > 0"),
        ({"TOLLGATE_ENV": "staging"}, "TOLLGATE_ENV must be"),
        ({"GATEWAY_IDLE_SPIN_US": "-1"}, "GATEWAY_IDLE_SPIN_US must be between 0 and 10000"),
        ({"GATEWAY_IDLE_SPIN_US": "20000"}, "GATEWAY_IDLE_SPIN_US must be between 0 and 10000"),
        ({"TOLLGATE_ENV": "production", "SECRET_KEY": ""}, "SECRET_KEY must be set in production"),
        ({"TOLLGATE_ENV": "production", "SECRET_KEY": "s" * 50, "TOLLGATE_KEY_PEPPER": ""},
         "TOLLGATE_KEY_PEPPER must be set in production"),
    ],
)
def test_malformed_values_fail_loudly(env: dict[str, str], message: str) -> None:
    result = load_settings(**env)
    assert result.returncode != 0
    assert message in result.stderr
