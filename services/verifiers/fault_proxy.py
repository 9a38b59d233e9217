"""A fault-injecting HTTP proxy for a sandbox service: rehearse a flaky or failing verifier
before a long run meets one.

It forwards every request to `target` (method, path, body, auth header) and, by its
`FaultConfig`, answers a seeded share with an HTTP error instead (`error_rate`), holds a share
without answering (`hang_rate`, for `hang_s`: a hung endpoint, met by the client's deadline), and
answers everything with 503 during an outage (`outage(seconds)`, or `--outage-after/--outage-s`).
Counts of what it did are in `FaultProxy.counts`.

    python -m threepo.services.verifiers.fault_proxy --target http://127.0.0.1:8080 --port 8081 \\
        --error-rate 0.3 --outage-after 60 --outage-s 40

`serve_in_thread(app)` runs any aiohttp application on loopback in a background thread (with
handler cancellation, as the sandbox server runs) for callers that are not async themselves:
tests of the driver, notebooks.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
from aiohttp import web

_FORWARDED_HEADERS = ("Authorization", "Content-Type", "X-Threepo-Deadline-S")


@dataclass(frozen=True)
class FaultConfig:
    """Which faults the proxy injects."""

    target: str
    """Base URL requests are forwarded to."""
    error_rate: float = 0.0
    """Share of requests answered `error_status` instead of being forwarded."""
    error_status: int = 503
    """Status of an injected error."""
    hang_rate: float = 0.0
    """Share of requests held without an answer for `hang_s`."""
    hang_s: float = 60.0
    """How long a held request hangs before the proxy drops it."""
    seed: int = 0
    """Seed of which requests get a fault."""

    def __post_init__(self) -> None:
        if not (0 <= self.error_rate <= 1 and 0 <= self.hang_rate <= 1 and self.error_rate + self.hang_rate <= 1):
            raise ValueError(f"FaultConfig: expected error_rate, hang_rate in [0, 1] summing to <= 1, "
                             f"got {self.error_rate}, {self.hang_rate}")
        if not 500 <= self.error_status <= 599:
            raise ValueError(f"FaultConfig.error_status: expected a 5xx status, got {self.error_status}")


class FaultProxy:
    """The proxy's request handling; `app()` is the aiohttp application."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self.counts: Counter[str] = Counter()  # requests, forwarded, error, hang, outage
        self.down_until = 0.0
        self.hang_all = False
        self._rng = random.Random(config.seed)
        self._session: aiohttp.ClientSession | None = None

    def outage(self, seconds: float) -> None:
        """Answer every request 503 for the next `seconds` (from now)."""
        self.down_until = time.monotonic() + seconds

    async def handle(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        self.counts["requests"] += 1
        draw = self._rng.random()
        if time.monotonic() < self.down_until:
            self.counts["outage"] += 1
            return web.Response(status=503, text="injected outage")
        if self.hang_all or draw < cfg.hang_rate:
            self.counts["hang"] += 1
            await asyncio.sleep(cfg.hang_s)
            return web.Response(status=504, text="injected hang ended")
        if draw < cfg.hang_rate + cfg.error_rate:
            self.counts["error"] += 1
            return web.Response(status=cfg.error_status, text="injected error")
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {k: request.headers[k] for k in _FORWARDED_HEADERS if k in request.headers}
        async with self._session.request(request.method, cfg.target.rstrip("/") + request.path_qs,
                                         data=await request.read(), headers=headers) as upstream:
            body = await upstream.read()
            self.counts["forwarded"] += 1
            return web.Response(status=upstream.status, body=body,
                                content_type=upstream.content_type)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)

        async def close(app: web.Application) -> None:
            if self._session is not None:
                await self._session.close()
        app.on_cleanup.append(close)
        return app


class BackgroundServer:
    """An aiohttp application served on `host:port` by its own event loop in a daemon thread."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, handler_cancellation=True)
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host, port)
            self.loop.run_until_complete(site.start())
            started.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._runner.cleanup())
            self.loop.close()

        self._thread = threading.Thread(target=serve, daemon=True, name="threepo-http")
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError(f"server on {host}:{port} did not start within 30 s")
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"

    def call(self, fn, *args):
        """Run `fn(*args)` on the server's loop (its state belongs to that thread) and return the result."""
        done, box = threading.Event(), []
        self.loop.call_soon_threadsafe(lambda: (box.append(fn(*args)), done.set()))
        done.wait(10)
        return box[0] if box else None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def serve_in_thread(app: web.Application, host: str = "127.0.0.1", port: int = 0) -> BackgroundServer:
    """Serve `app` from a background thread; `.url` is where, `.stop()` ends it."""
    return BackgroundServer(app, host, port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fault-injecting proxy in front of a sandbox service")
    parser.add_argument("--target", required=True, help="base URL to forward to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--hang-rate", type=float, default=0.0)
    parser.add_argument("--hang-s", type=float, default=60.0)
    parser.add_argument("--outage-after", type=float, default=None, help="seconds until an outage starts")
    parser.add_argument("--outage-s", type=float, default=40.0, help="length of that outage")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    proxy = FaultProxy(FaultConfig(args.target, args.error_rate, hang_rate=args.hang_rate,
                                   hang_s=args.hang_s, seed=args.seed))
    app = proxy.app()
    if args.outage_after is not None:
        async def schedule(app: web.Application) -> None:
            asyncio.get_running_loop().call_later(args.outage_after, proxy.outage, args.outage_s)
        app.on_startup.append(schedule)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True)


if __name__ == "__main__":
    main()
