# Tollgate: the two commands of the quick start are `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up down test test-browser ci bench bench-turns bench-floor bench-ledger bench-background bench-console bench-abuse bench-quota clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Settings refuse to load without TOLLGATE_ENV (config/settings.py): the quick start and the
# benchmarks are development; `make test` runs as test (tests/session_env.py).
up bench bench-turns bench-floor bench-ledger bench-background bench-console bench-quota down clean: export TOLLGATE_ENV ?= development

# Bring the whole system up on embedded defaults: Redis and PostgreSQL from pip packages under
# .data/, migrations, the demo tenant / project / key (printed once), the mock upstream on :8099
# as its provider, and the gateway on :8000 (2 uvicorn workers). Ctrl-C stops the servers;
# `make down` stops Redis and PostgreSQL.
up: $(STAMP)
	$(PY) -m config.embedded start
	$(PY) manage.py migrate --noinput
	$(PY) manage.py demo_setup --mock-upstream http://127.0.0.1:8099/v1
	$(PY) -m config.serve --port 8000 --mock-port 8099

# The whole test suite against real Redis, a real Redis Cluster and real PostgreSQL, which the
# fixtures start under a temporary directory and stop at the end.
test: $(STAMP)
	.ci/ensure-chromium
	.ci/ensure-pgbouncer
	$(PY) -m pytest

# Only the console in headless Chromium (Debian's /usr/bin/chromium, or TOLLGATE_CHROMIUM) against
# a running gateway; screenshots go to build/screenshots/ (TOLLGATE_SCREENSHOT_DIR).
test-browser: $(STAMP)
	.ci/ensure-chromium
	$(PY) -m pytest tests/browser

# What CI runs: `make test` (which installs Debian's chromium and pgbouncer first when missing).
ci:
	.ci/run

# The same load straight at the mock upstream and through the gateway (all checks on), in one
# run on its own embedded services; prints throughput, latency, Redis and database work per
# request and the gateway's peak RSS (docs/benchmarks.md). ARGS adds options (e.g. --cpu-awake).
bench: $(STAMP)
	$(PY) -m config.bench $(ARGS)

# This checkout's gateway and other checkouts' (ARGS: --tree NAME=PATH, repeatable; --baseline
# NAME), by turns on one bench system, wrk at one connection: each tree's added p50, p99 and CPU
# per call, and the ratio to the baseline by the median of the turns' ratios (docs/benchmarks.md,
# "Trees by turns"). Needs wrk (apt-get install wrk).
bench-turns: $(STAMP)
	$(PY) -m config.bench_turns $(ARGS)

# The floor of a plain call: the same call's work (the gateway's own reserve and settle scripts,
# the upstream call) with the least Python, then with each layer the gateway runs on added
# (uvicorn, the httpx transport, Django's request and response), and the gateway, by turns at
# 1 and 16 clients (docs/benchmarks.md, "The floor of a plain call, layer by layer").
bench-floor: $(STAMP)
	$(PY) -m config.bench_floor $(ARGS)

# The ledger's readers (tenant and platform reports, dashboard, /metrics) and the drain at 20,000
# rows and at ROWS (default 20,000,000) synthetic rows COPYed into the partitioned ledger, on
# its own embedded services (docs/benchmarks.md, "The ledger at scale"). ARGS adds options.
ROWS ?= 20000000
bench-ledger: $(STAMP)
	$(PY) -m config.bench_ledger --rows $(ROWS) $(ARGS)

# The background jobs (drain, sweep, alert and health detectors) at 100,000 tenants of which 10
# are active, on its own embedded services: one run of each before the index of active tenants
# and with it, and their full walk (docs/benchmarks.md, "Background jobs at 100,000 tenants").
# ARGS adds options (--tenants, --active, --no-before).
bench-background: $(STAMP)
	$(PY) -m config.bench_background $(ARGS)

# Every console page and management API list of one tenant with 20,000 API keys over 200
# projects and 1,000,000 audit events, on its own embedded services: each page's median time and
# size against 100 ms and 200 KB (docs/benchmarks.md, "The console at a tenant's real size").
# ARGS adds options (--keys, --projects, --events, --repeat).
bench-console: $(STAMP)
	$(PY) -m config.bench_console $(ARGS)

# Small calls of one tenant on one gateway worker alone, beside a stream of 400 KB prompts, and
# beside a flood of random API keys from one client address and from a new address per request
# (docs/benchmarks.md, "Abuse").
bench-abuse: $(STAMP)
	$(PY) -m config.bench_abuse

bench-quota: $(STAMP)
	$(PY) -m config.embedded start
	$(PY) manage.py bench_quota $(ARGS)

down: $(STAMP)
	$(PY) -m config.embedded stop

clean: down
	rm -rf .data
