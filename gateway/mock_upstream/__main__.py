"""`python -m gateway.mock_upstream --port N [--host 127.0.0.1] [--workers 1]`."""
from __future__ import annotations

import argparse

from gateway.mock_upstream.server import run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.mock_upstream",
        description="OpenAI-compatible mock LLM upstream with latency and fault injection.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--workers", type=int, default=1,
                        help="uvicorn worker processes; the bill endpoint is exact only with 1")
    parser.add_argument("--log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--access-log", action="store_true", help="log every request (slower)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    run(host=args.host, port=args.port, workers=args.workers, log_level=args.log_level,
        access_log=args.access_log)


if __name__ == "__main__":
    main()
