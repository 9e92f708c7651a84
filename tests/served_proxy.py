"""A small HTTP proxy in front of a real server, on 127.0.0.1, for the faults a real server cannot be made to show:
500s, dropped connections, bodies cut short, answers for other ids, NaN, a replica that dies mid-job, a key required.
Everything else it forwards unchanged. Bounded: it serves only while its test runs and only on the loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Faults:
    fail_first: int = 0  # the first N completions requests answer 500
    drop_every: int = 0  # every k-th completions request: the connection is closed without an answer
    truncate_every: int = 0  # every k-th: the body cut in half
    garble: bool = False  # prompt log-probs keyed by other ids than were sent
    nan: bool = False  # a NaN log-prob in the answer
    die_after: int | None = None  # after N completions requests, every request is refused at the socket
    require_key: str | None = None  # answer 401 unless "Authorization: Bearer KEY"
    seen: int = 0
    paths: list = field(default_factory=list)


class LoopbackServer:
    """An aiohttp application served on a free 127.0.0.1 port from its own thread and event loop, until :meth:`close`
    (which a test must call: a thread left running at exit aborts the process). Subclasses give :meth:`app`."""

    def start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), f"{type(self).__name__} did not start"

    def app(self):
        raise NotImplementedError

    def _serve(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.app())
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


class Proxy(LoopbackServer):
    def __init__(self, target: str, faults: Faults | None = None):
        self.target = target.rstrip("/")
        self.faults = faults or Faults()
        self.start()

    def app(self):
        from aiohttp import ClientSession, web

        faults = self.faults

        async def handle(request: web.Request):
            f = faults
            completions = request.path.endswith("/completions") or request.path == "/generate"
            if f.require_key is not None and request.headers.get("Authorization") != f"Bearer {f.require_key}":
                return web.Response(status=401, text='{"error": "unauthorized"}')
            if completions:
                f.seen += 1
                n = f.seen
                if f.die_after is not None and n > f.die_after:
                    request.transport.close()
                    return web.Response(status=503)
                if n <= f.fail_first:
                    return web.Response(status=500, text="internal error")
                if f.drop_every and n % f.drop_every == 0:
                    request.transport.close()
                    return web.Response(status=500)
            body = await request.read()
            async with ClientSession() as session:
                async with session.request(request.method, self.target + request.path_qs, data=body,
                                           headers={"Content-Type": "application/json"}) as resp:
                    payload = await resp.read()
                    status = resp.status
            if completions and status == 200:
                if f.truncate_every and f.seen % f.truncate_every == 0:
                    payload = payload[: len(payload) // 2]
                elif f.garble or f.nan:
                    data = json.loads(payload)
                    rows = data["choices"][0].get("prompt_logprobs") or []
                    for j, entry in enumerate(rows):
                        if entry and j == len(rows) - 1:
                            if f.garble:
                                rows[j] = {str(int(k) + 1): v for k, v in entry.items()}
                            if f.nan:
                                for v in entry.values():
                                    v["logprob"] = float("nan")
                    payload = json.dumps(data).replace("NaN", "NaN").encode()
            return web.Response(status=status, body=payload, content_type="application/json")

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", handle)
        return app
