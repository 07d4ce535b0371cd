"""A bounded load test of a running API: concurrent clients (asyncio + httpx) for a fixed time.

Each client sends batches of random sequences (its own seeded generator), each under a new
Idempotency-Key; now and then it sends its previous request again under the same key, as a client
does after a lost answer, and checks that the server answers it again identically and free. The result
counts what was sent and received, so the caller can check the ledger against it: the queries charged
must equal the fresh answers received (none lost, none charged twice).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoadResult:
    clients: int
    seconds: float
    requests: int                 # requests answered 200
    fresh_queries: int            # queries in answers that were charged (replayed = false)
    retries: int                  # requests repeated under the same key (answered from the ledger)
    retry_mismatches: int         # repeated requests whose answer differed from the first (must be 0)
    errors_5xx: int
    other_errors: int             # non-200 answers other than 5xx, and transport errors
    p50_ms: float
    p99_ms: float
    throughput_rps: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


async def _client(url: str, key: str, d: int, seconds: float, seed: int, batch: int, tokens: int, out: dict):
    import httpx
    rng = np.random.default_rng(seed)
    headers = {"Authorization": f"Bearer {key}"}
    lat, fresh, ok, retries, mism, e5, other = [], 0, 0, 0, 0, 0, 0
    prev = None
    deadline = time.perf_counter() + seconds
    i = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while time.perf_counter() < deadline and i < 1_000_000:
            i += 1
            if prev is not None and rng.random() < 0.2:
                idem, body, first = prev
                retry = True
            else:
                X = rng.normal(size=(int(rng.integers(1, batch + 1)), tokens, d))
                idem, body, first = f"c{seed}-{i}", {"sequences": X.tolist()}, None
                retry = False
            t0 = time.perf_counter()
            try:
                r = await c.post("/v1/query", json=body, headers={**headers, "Idempotency-Key": idem})
            except httpx.TransportError:
                other += 1
                continue
            lat.append(time.perf_counter() - t0)
            if r.status_code >= 500:
                e5 += 1
                continue
            if r.status_code != 200:
                other += 1
                continue
            doc = r.json()
            ok += 1
            if retry:
                retries += 1
                if doc["values"] != first or not doc["replayed"]:
                    mism += 1
            else:
                fresh += len(doc["values"]) if not doc["replayed"] else 0
                prev = (idem, body, doc["values"])
    out[seed] = (lat, fresh, ok, retries, mism, e5, other)


def run_load(url: str, key: str, *, d: int, clients: int = 8, seconds: float = 3.0, batch: int = 8, tokens: int = 4,
             seed: int = 0) -> LoadResult:
    """``clients`` concurrent clients on one key for ``seconds`` seconds; see the module docstring."""
    out: dict = {}

    async def main():
        await asyncio.gather(*(_client(url, key, d, seconds, seed * 1000 + i, batch, tokens, out)
                               for i in range(clients)))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    lat = np.concatenate([np.asarray(v[0]) for v in out.values()]) if out else np.zeros(0)
    tot = [sum(v[k] for v in out.values()) for k in range(1, 7)]
    return LoadResult(clients=clients, seconds=round(wall, 2), requests=tot[1], fresh_queries=tot[0], retries=tot[2],
                      retry_mismatches=tot[3], errors_5xx=tot[4], other_errors=tot[5],
                      p50_ms=round(float(np.percentile(lat, 50)) * 1e3, 2) if lat.size else float("nan"),
                      p99_ms=round(float(np.percentile(lat, 99)) * 1e3, 2) if lat.size else float("nan"),
                      throughput_rps=round(tot[1] / wall, 1))
