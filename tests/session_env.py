"""Loaded with `-p tests.session_env` (pyproject addopts) so it runs before pytest-django reads
the settings: every test session gets its own data directory for the embedded Redis and
PostgreSQL, and never touches the data of `make up` nor of another run."""
from __future__ import annotations

import os
import tempfile

if "TOLLGATE_DATA_DIR" not in os.environ:
    # Short path: PostgreSQL and Redis listen on unix sockets inside it (108-byte limit).
    os.environ["TOLLGATE_DATA_DIR"] = tempfile.mkdtemp(prefix="tgt-", dir="/tmp")
    os.environ["TOLLGATE_TEST_OWNS_DATA_DIR"] = "1"
os.environ.setdefault("TOLLGATE_ENV", "test")
