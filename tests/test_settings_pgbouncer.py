"""DATABASE_PGBOUNCER (config/settings.py): server-side cursors off, prepared statements pinned
off, and a DATABASE_URL asking for prepared statements refused at start-up."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
URL = "postgres://app@pgbouncer.internal:6432/tollgate"
SHOW = ("import json, config.settings as s; d = s.DATABASES['default']; "
        "print(json.dumps([d.get('DISABLE_SERVER_SIDE_CURSORS', False), "
        "d.get('OPTIONS', {}).get('prepare_threshold', 'unset'), s.DATABASE_PGBOUNCER]))")


def load(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SHOW], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_off_by_default_leaves_django_as_it_is() -> None:
    result = load(DATABASE_URL=URL)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [False, "unset", False]


def test_on_disables_server_side_cursors_and_prepared_statements() -> None:
    result = load(DATABASE_URL=URL, DATABASE_PGBOUNCER="true")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [True, None, True]


def test_a_prepare_threshold_in_the_url_is_refused() -> None:
    result = load(DATABASE_URL=f"{URL}?prepare_threshold=5", DATABASE_PGBOUNCER="true")
    assert result.returncode != 0
    assert "DATABASE_PGBOUNCER is set: DATABASE_URL must not set prepare_threshold" in result.stderr


def test_a_typo_fails_loudly() -> None:
    result = load(DATABASE_URL=URL, DATABASE_PGBOUNCER="yes please")
    assert result.returncode != 0
    assert "DATABASE_PGBOUNCER must be true or false" in result.stderr
