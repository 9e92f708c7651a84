"""The served engine's HTTP layer: the replicas, one aiohttp session, and the loop that sends every request until it is
answered, spreading the requests over the live replicas by load (opdcache/backends/served.py uses it).

A request that fails in a way another attempt may mend (a 5xx or 429, a dropped connection, a timeout, a body that is
not JSON) is :class:`Retry`, tried again with backoff on any replica; a replica failing REPLICA_FAILURES times in a row
is dropped; 401/403 is a one-line ConfigError naming the key; another 4xx is final. Results come back in the requests'
order, whichever replica answered.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit, urlunsplit

from opdcache.errors import ConfigError, OpdcacheError

DEFAULT_CONCURRENCY = 64  # requests in flight a replica, where the server advertises no limit
RETRIES = 6  # attempts a request gets, over all replicas, before the job stops
REPLICA_FAILURES = 3  # consecutive failures after which a replica is dropped
FULL_ROW_MAX_VOCAB = 8192
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 34 = 46; print('hello')"
API_KEY_ENV = ("OPDCACHE_API_KEY", "OPENAI_API_KEY")


class ServerError(OpdcacheError, RuntimeError):
    """A server failed in a way a retry cannot mend (every replica down, an answer for other ids, a NaN)."""


class Retry(Exception):
    """A failure worth another attempt (a 5xx, a dropped connection, a timeout, a body cut short)."""


def split_urls(text: str | None) -> tuple[str, ...]:
    """``--server-url`` as its replicas' base URLs (comma-separated; ``/v1`` and a trailing ``/`` dropped)."""
    urls = tuple(u.strip().rstrip("/") for u in (text or "").split(",") if u.strip())
    out = []
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"--server-url takes http(s)://host:port URLs, comma-separated; got {url!r}")
        path = re.sub(r"/v1$", "", parts.path)
        out.append(urlunsplit((parts.scheme, parts.netloc, path, "", "")))
    return tuple(out)


def redact(url: str) -> str:
    """A URL as messages show it: without credentials."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return urlunsplit((parts.scheme, host + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))


def api_key(given: str | None) -> str | None:
    return given or next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


# ---------------------------------------------------------------------------------------------- the HTTP layer

@dataclass
class Replica:
    url: str
    concurrency: int = DEFAULT_CONCURRENCY
    failures: int = 0
    alive: bool = True
    answered: int = 0


class Pool:
    """The replicas and one aiohttp session: ``run(jobs)`` sends each job (an async function of (session, replica))
    until it succeeds, spreading them over the live replicas by load, and returns the results in the jobs' order."""

    def __init__(self, urls: Sequence[str], key: str | None, timeout: float, concurrency: int | None):
        self.replicas = [Replica(u, concurrency or DEFAULT_CONCURRENCY) for u in urls]
        self.key, self.timeout = key, timeout

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    async def request(self, session, replica: Replica, method: str, path: str, body: dict | None = None) -> dict:
        """One JSON request; a 5xx, a dropped connection, a timeout or a body that is not JSON is :class:`Retry`;
        401/403 and other 4xx are final."""
        import aiohttp

        try:
            async with session.request(method, replica.url + path, json=body, headers=self.headers()) as resp:
                text = await resp.text()
                if resp.status in (401, 403):
                    raise ConfigError(f"{redact(replica.url)} answered {resp.status} (it needs an API key): pass --api-key, "
                                      f"or set {API_KEY_ENV[0]}")
                if resp.status >= 500 or resp.status == 429:
                    raise Retry(f"HTTP {resp.status}")
                if resp.status >= 400:
                    raise ServerError(f"{redact(replica.url)}{path} refused the request (HTTP {resp.status}: "
                                      f"{text.strip()[:300]})")
                try:
                    return json.loads(text)
                except ValueError:
                    raise Retry(f"a body that is not JSON ({len(text)} bytes)") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise Retry(f"{type(exc).__name__}: {str(exc)[:200]}") from None

    async def _run(self, jobs: list, describe) -> list:
        import aiohttp

        results: list = [None] * len(jobs)
        if not jobs:
            return results
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(len(jobs)):
            queue.put_nowait((i, 0))
        finished = asyncio.Event()  # every job answered, or the job stopped (``error``)
        remaining = [len(jobs)]
        error: list = []

        def stop(exc: BaseException) -> None:
            error.append(exc)
            finished.set()

        async def worker(session, replica: Replica):
            while replica.alive and not finished.is_set():
                i, attempt = await queue.get()
                try:
                    results[i] = await jobs[i](session, replica)
                except Retry as exc:
                    replica.failures += 1
                    if replica.failures >= REPLICA_FAILURES:
                        replica.alive = False
                    alive = sum(r.alive for r in self.replicas)
                    if attempt + 1 >= RETRIES or not alive:
                        stop(ServerError(f"{describe(i)} failed {attempt + 1} times ({exc}); the last from "
                                         f"{redact(replica.url)}; {alive} of {len(self.replicas)} replicas still answer. "
                                         "Check the servers, then rerun the same command: finished shards are kept"))
                        return
                    await asyncio.sleep(min(0.2 * 2 ** attempt, 5.0) * (0.5 + random.random()))
                    queue.put_nowait((i, attempt + 1))
                    continue
                except BaseException as exc:  # a final refusal: the job stops with it
                    stop(exc)
                    return
                replica.failures = 0
                replica.answered += 1
                remaining[0] -= 1
                if remaining[0] == 0:
                    finished.set()

        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [asyncio.create_task(worker(session, r)) for r in self.replicas if r.alive for _ in range(r.concurrency)]
            everyone = asyncio.create_task(asyncio.wait(tasks))  # every worker gone: the replicas all dropped
            await asyncio.wait([asyncio.create_task(finished.wait()), everyone], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            everyone.cancel()
        if error:
            raise error[0]
        if remaining[0]:
            raise ServerError(f"no replica answers any more ({len(self.replicas)} given); check the servers, then rerun the "
                              "same command: finished shards are kept")
        return results

    def run(self, jobs: list, describe=lambda i: f"request {i}") -> list:
        return asyncio.run(self._run(jobs, describe))

    def each(self, method: str, path: str, body: dict | None = None) -> list:
        """The same request to every replica, once each (start-up: identity), failures as ConfigError."""
        async def go():
            import aiohttp

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=min(self.timeout, 60))) as session:
                out = []
                for replica in self.replicas:
                    for attempt in range(RETRIES):
                        try:
                            out.append(await self.request(session, replica, method, path, body))
                            break
                        except Retry as exc:
                            if attempt + 1 == RETRIES:
                                raise ConfigError(f"--server-url {redact(replica.url)}: {path} did not answer ({exc}, "
                                                  f"{RETRIES} tries); start the server, or check the URL and port") from None
                            await asyncio.sleep(min(0.2 * 2 ** attempt, 2.0))
                        except ServerError as exc:
                            out.append({"_error": str(exc)})
                            break
                return out
        return asyncio.run(go())


