"""One client process of the HTTP race: fire N concurrent chat completions at the gateway and
report each outcome. Spawned, so it imports nothing of Django."""
from __future__ import annotations

import asyncio
from multiprocessing.synchronize import Barrier

import httpx


async def _fire(base_url: str, key: str, model: str, n: int, barrier: Barrier) -> list[tuple]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:
        body = {"model": model, "messages": [{"role": "user", "content": "race"}],
                "max_tokens": 10}
        headers = {"Authorization": f"Bearer {key}"}
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)

        async def one() -> tuple:
            response = await client.post("/chat/completions", json=body, headers=headers)
            try:
                data = response.json()
            except ValueError:
                return (response.status_code, 0, f"not json: {response.text[:200]}")
            if response.status_code == 200:
                return (200, data["usage"]["total_tokens"], None)
            return (response.status_code, 0, data["error"]["code"])

        return await asyncio.gather(*(one() for _ in range(n)))


def run(base_url: str, key: str, model: str, n: int, barrier: Barrier) -> list[tuple]:
    return asyncio.run(_fire(base_url, key, model, n, barrier))
