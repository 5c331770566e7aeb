"""TOLLGATE_BREAKER_* settings: defaults, and a bad value stops startup with a clear message."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PRINT = ("import config.settings as s; print(s.TOLLGATE_BREAKER_WINDOW_SECONDS, "
          "s.TOLLGATE_BREAKER_MIN_CALLS, s.TOLLGATE_BREAKER_ERROR_PERCENT, "
          "s.TOLLGATE_BREAKER_COOLDOWN_SECONDS, s.TOLLGATE_BREAKER_PROBES, "
          "s.TOLLGATE_BREAKER_FLUSH_SECONDS)")


def load(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PRINT], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_defaults() -> None:
    names = ("WINDOW_SECONDS", "MIN_CALLS", "ERROR_PERCENT", "COOLDOWN_SECONDS", "PROBES",
             "FLUSH_SECONDS")
    env = {k: v for k, v in os.environ.items()
           if not any(k == f"TOLLGATE_BREAKER_{n}" for n in names)}
    result = subprocess.run([sys.executable, "-c", _PRINT], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["30.0", "10", "50", "30.0", "3", "5.0"]


@pytest.mark.parametrize(("env", "message"), [
    ({"TOLLGATE_BREAKER_MIN_CALLS": "0"}, "TOLLGATE_BREAKER_MIN_CALLS must be a positive"),
    ({"TOLLGATE_BREAKER_PROBES": "-1"}, "TOLLGATE_BREAKER_PROBES must be a positive"),
    ({"TOLLGATE_BREAKER_ERROR_PERCENT": "101"}, "TOLLGATE_BREAKER_ERROR_PERCENT must be 1-100"),
    ({"TOLLGATE_BREAKER_ERROR_PERCENT": "half"}, "invalid literal"),
    ({"TOLLGATE_BREAKER_WINDOW_SECONDS": "0"}, "TOLLGATE_BREAKER_WINDOW_SECONDS must be"),
    ({"TOLLGATE_BREAKER_COOLDOWN_SECONDS": "100000"}, "TOLLGATE_BREAKER_COOLDOWN_SECONDS must be"),
    ({"TOLLGATE_BREAKER_FLUSH_SECONDS": "-1"}, "TOLLGATE_BREAKER_FLUSH_SECONDS must be"),
])
def test_bad_values_fail_loudly(env: dict[str, str], message: str) -> None:
    result = load(**env)
    assert result.returncode != 0
    assert message in result.stderr
