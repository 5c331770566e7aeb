"""The project installs as a package: `pip install .` into a directory outside the checkout, then,
from another working directory with only that directory on the path, Django starts, the Lua
scripts, the console's templates and its static files are found inside the installed copy."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

_PROBE = """
import json, django
django.setup()
from django.contrib.staticfiles import finders
from django.template.loader import get_template
from quotas import scripts
print(json.dumps({
    "lua_dir": str(scripts.LUA_DIR),
    "scripts": sorted(s.name for s in scripts.ALL),
    "reserve_header": scripts.RESERVE.text.splitlines()[0],
    "template": get_template("console/base.html").origin.name,
    "static": finders.find("console/console.css"),
    "migrations": sorted(p.name for p in (Path(__import__("billing").__file__).parent
                                         / "migrations").glob("0001_*.py")),
}))
""".replace("import json, django", "import json, django\nfrom pathlib import Path")


@pytest.mark.slow
def test_pip_install_outside_the_repository_works(tmp_path: Path) -> None:
    site = tmp_path / "site"
    # Build isolation fetches the build backend named in pyproject.toml, as any install does.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(site), str(REPO)], check=True, cwd=tmp_path, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "TOLLGATE_DATA_DIR": str(tmp_path / "data"),
           "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONSAFEPATH": "1"}
    probe = subprocess.run([sys.executable, "-c", _PROBE], check=True, cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=120)
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    for where in ("lua_dir", "template", "static"):
        assert found[where].startswith(str(site)), (where, found[where])
    assert found["scripts"] == sorted(p.stem for p in (REPO / "lua").glob("*.lua"))
    assert found["reserve_header"].startswith("--[[ reserve.lua")
    assert found["migrations"] == ["0001_initial.py"]
