"""The verifier pool against the real sandbox server behind a real fault-injecting proxy on loopback
(services/verifiers/fault_proxy.py): 30% 5xx, an outage, a hang, and every endpoint down for good.

The outage is scaled down from the 40 s of the issue to 4 s (with the breaker's cooldown scaled
from 5 s to 0.3 s), and the outage bound from 180 s to 1.5 s, so the file runs in seconds; the
rules under test do not depend on the scale. A flaky or briefly down service is waited out (no
infra_error reaches the caller); one that stays down past the bound raises VerifierOutage."""

import asyncio
import os
import shutil
import time

import aiohttp
import pytest
from aiohttp import web

from threepo.services.verifiers.base import VerifierOutage
from threepo.services.verifiers.fault_proxy import FaultConfig, FaultProxy
from threepo.services.verifiers.pool import VerifierConfig, VerifierPool
from threepo.services.verifiers.sandbox import SandboxConfig
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig
from threepo.services.verifiers.sandbox_server import SERVICE, SandboxServerConfig, make_app
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyStatus

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap missing: apt-get install -y bubblewrap")

POOL = VerifierConfig(route=(("code_output", "remote_sandbox"),), max_concurrency=8, infra_retries=0)
FAST = dict(compile_timeout_s=0.1, run_timeout_s=2.0, request_margin_s=1.0, backoff_base_s=0.05, backoff_max_s=0.3,
            cooldown_s=0.3, outage_s=1.5)


def batch(n: int) -> tuple[list[VerifyRequest], list[VerifyStatus]]:
    """n code_output rows, every third answered wrongly."""
    requests, expected = [], []
    for i in range(n):
        item = TaskItem(uid=f"c{i}", prompt="", answer=str(i * 7), verifier="code_output")
        wrong = i % 3 == 2
        requests.append(VerifyRequest(item, f"\\boxed{{print({i}*7{'+1' if wrong else ''})}}"))
        expected.append(VerifyStatus.WRONG if wrong else VerifyStatus.OK)
    return requests, expected


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, "http://127.0.0.1:%d" % runner.addresses[0][1]


async def with_proxies(n_proxies, body, workers=2, **fault):
    """Run `body(proxies, urls)` against a sandbox server behind `n_proxies` fault proxies."""
    server = make_app(SandboxServerConfig(port=0, workers=workers, sandbox=SandboxConfig(wall_timeout_s=2.0)))
    runners = []
    try:
        runner, url = await start(server)
        runners.append(runner)
        proxies, urls = [], []
        for k in range(n_proxies):
            proxy = FaultProxy(FaultConfig(url, seed=k, **fault))
            runner, proxy_url = await start(proxy.app())
            runners.append(runner)
            proxies.append(proxy)
            urls.append(proxy_url)
        return await body(proxies, urls)
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def verify(urls, requests, **overrides):
    pool = VerifierPool(POOL, sandbox=RemoteSandboxConfig(**{**FAST, "endpoints": tuple(urls), **overrides}))
    try:
        return await pool.averify_batch(requests)
    finally:
        for verifier in pool._verifiers.values():
            await verifier.aclose()


def test_thirty_percent_5xx_is_waited_out_with_no_infra_error():
    requests, expected = batch(24)

    async def body(proxies, urls):
        return await verify(urls, requests), proxies[0].counts
    results, counts = asyncio.run(with_proxies(1, body, error_rate=0.3))
    assert [r.status for r in results] == expected  # zero infra_errors, every row scored
    assert counts["error"] >= 3 and counts["forwarded"] == 24  # faults were injected, each row ran once
    assert counts["requests"] == counts["error"] + counts["forwarded"]


def test_an_outage_shorter_than_the_bound_is_waited_out():
    requests, expected = batch(12)

    async def body(proxies, urls):
        proxies[0].outage(4.0)  # the 40 s outage, scaled down (see the module docstring)
        started = time.monotonic()
        results = await verify(urls, requests, outage_s=30.0)
        return results, time.monotonic() - started, proxies[0].counts
    results, elapsed, counts = asyncio.run(with_proxies(1, body))
    assert [r.status for r in results] == expected
    assert elapsed >= 4.0 and counts["outage"] >= 5  # they waited (breaker probes), then completed
    assert counts["outage"] < 60  # an open breaker lets one probe through per cooldown, not a storm


def test_a_hanging_endpoint_hits_the_deadline_and_is_retried_elsewhere():
    requests, expected = batch(6)

    async def body(proxies, urls):
        proxies[0].hang_all = True
        started = time.monotonic()
        results = await verify(urls, requests, run_timeout_s=1.0, request_margin_s=0.5, queue_timeout_s=0.5)
        return results, time.monotonic() - started, [p.counts for p in proxies]
    results, elapsed, (hung, healthy) = asyncio.run(with_proxies(2, body, hang_s=30.0))
    assert [r.status for r in results] == expected
    assert hung["hang"] >= 1 and healthy["forwarded"] == 6
    assert elapsed < 15  # bounded by the deadline (2.1 s), not by the 30 s hang


def test_every_endpoint_down_past_the_bound_raises_verifier_outage():
    requests, _ = batch(6)

    async def body(proxies, urls):
        for proxy in proxies:
            proxy.outage(3600)
        started = time.monotonic()
        with pytest.raises(VerifierOutage) as raised:
            await verify(urls, requests)
        return time.monotonic() - started, str(raised.value)
    elapsed, message = asyncio.run(with_proxies(2, body))
    assert 1.5 <= elapsed < 10 and "no sandbox endpoint answered" in message and "outage_s=1.5" in message


def test_a_request_no_endpoint_can_serve_ends_as_infra_error_while_others_succeed():
    requests, expected = batch(6)
    poison = TaskItem(uid="p", prompt="", answer="1", verifier="code_output")

    @web.middleware
    async def refuse_poison(request, handler):
        if b"POISON" in await request.read():
            return web.Response(status=500, text="crashes on this one")
        return await handler(request)

    async def body(proxies, urls):
        app = make_app(SandboxServerConfig(port=0, workers=2, sandbox=SandboxConfig(wall_timeout_s=2.0)),
                       middlewares=(refuse_poison,))
        runner, url = await start(app)
        try:
            return await verify([url], [*requests, VerifyRequest(poison, "\\boxed{print(1) # POISON}")],
                                max_attempts=3, unhealthy_after=100)
        finally:
            await runner.cleanup()
    results = asyncio.run(with_proxies(0, body))
    assert [r.status for r in results[:-1]] == expected
    assert results[-1].status is VerifyStatus.INFRA_ERROR and "3 failed attempts" in results[-1].details


async def raw_post(url, body, timeout=5.0, headers=None):
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/run_code", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return response.status, await response.text()


@pytest.mark.parametrize("field,value,needle", [
    ("run_timeout", "5", "`run_timeout`: expected a number, got str"),
    ("run_timeout", True, "`run_timeout`: expected a number, got bool"),
    ("run_timeout", -1, "`run_timeout`: expected a number > 0"),
    ("compile_timeout", [1], "`compile_timeout`: expected a number, got list"),
    ("memory_limit_MB", 512.5, "`memory_limit_MB`: expected an integer, got float"),
    ("stdin", 7, "`stdin`: expected a string, got int"),
    ("files", ["a"], "`files`: expected an object of path -> base64 string, got list"),
    ("files", {"a.txt": 3}, "`files.a.txt`: expected a base64 string, got int"),
    ("files", {"a.txt": "%%%"}, "`files.a.txt`: expected base64"),
    ("files", {"../a.txt": "YQ=="}, "`files`: files: expected a relative path"),
    ("code", None, "field `code` is required"),
    ("code", 12, "`code`: expected a string, got int"),
    ("language", "cpp", "`language`: 'cpp' unsupported"),
    ("fetch_files", "x", "`fetch_files`: expected a list of strings"),
])
def test_malformed_requests_get_400_naming_the_field(field, value, needle):
    body = {"code": "print(1)", "language": "python", field: value}
    if value is None:
        del body[field]

    async def go(_, __):
        runner, url = await start(make_app(SandboxServerConfig(port=0)))
        try:
            return await raw_post(url, body)
        finally:
            await runner.cleanup()
    status, text = asyncio.run(with_proxies(0, go))
    assert status == 400 and needle in text, text


@pytest.mark.parametrize("config,needle", [
    ({"dataset_type": "Other"}, "`config.dataset_type`"),
    ({"dataset_type": "CommonOJDataset", "run_timeout": "3", "provided_data": {"test": []}}, "`run_timeout`"),
    ({"dataset_type": "CommonOJDataset", "provided_data": {"test": {"input": {}}}}, "`test`: expected a list"),
    ({"dataset_type": "CommonOJDataset", "provided_data": {"test": [{"input": {"stdin": 1}, "output": {}}]}},
     "test[0].input: field `stdin`: expected a string, got int"),
])
def test_malformed_submissions_get_400_naming_the_field(config, needle):
    async def go(_, __):
        runner, url = await start(make_app(SandboxServerConfig(port=0)))
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/submit", json={"completion": "x", "config": config}) as r:
                    return r.status, await r.text()
        finally:
            await runner.cleanup()
    status, text = asyncio.run(with_proxies(0, go))
    assert status == 400 and needle in text, text


def test_queued_work_of_a_client_that_gave_up_never_runs():
    async def go(_, __):
        app = make_app(SandboxServerConfig(port=0, workers=1, sandbox=SandboxConfig(wall_timeout_s=5.0)))
        service = app[SERVICE]
        runner, url = await start(app)
        try:
            busy = asyncio.ensure_future(raw_post(url, {"code": "import time; time.sleep(1.5)"}))
            await asyncio.sleep(0.3)  # the only worker is taken
            with pytest.raises(asyncio.TimeoutError):  # this client disconnects while queued
                await raw_post(url, {"code": "print('late')"}, timeout=0.3)
            expired = await raw_post(url, {"code": "print('late')"}, headers={"X-Threepo-Start-By-S": "0.3"})
            assert (await busy)[0] == 200
            await asyncio.sleep(0.2)
            return expired, dict(service.stats)
        finally:
            await runner.cleanup()
    (status, text), stats = asyncio.run(with_proxies(0, go))
    assert status == 504 and "not run" in text
    assert stats["started"] == 1 and stats["cancelled_in_queue"] == 1 and stats["expired_in_queue"] == 1


def test_the_server_states_its_interpreter():
    async def go(_, __):
        runner, url = await start(make_app(SandboxServerConfig(port=0)))
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/v1/info") as r:
                    info = await r.json()
                async with session.post(url + "/run_code", json={
                        "code": "import platform, sys; print(platform.python_implementation(), "
                                "platform.python_version(), sys.executable)", "language": "python"}) as r:
                    ran = (await r.json())["run_result"]["stdout"].strip()
            return info, ran
        finally:
            await runner.cleanup()
    info, ran = asyncio.run(with_proxies(0, go))
    assert info["interpreter"] == ran and info["interpreter"].startswith("CPython 3.")


def test_a_refused_connection_past_the_bound_raises_verifier_outage_even_when_backoff_outlasts_the_cooldown():
    # nothing listens: every attempt fails at once; retries back off longer than the breaker's
    # cooldown, so a half-open probe is always due when the next attempt starts
    import socket

    from threepo.services.verifiers.remote import RemoteSandboxVerifier

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    verifier = RemoteSandboxVerifier(RemoteSandboxConfig(endpoints=(url,), outage_s=2.0, cooldown_s=0.2,
                                                         backoff_base_s=0.5, backoff_max_s=1.0))
    item = TaskItem(uid="c", prompt="", answer="3\n", verifier="code_output")

    async def run():
        started = time.monotonic()
        with pytest.raises(VerifierOutage):
            await verifier.verify(VerifyRequest(item, "\\boxed{print(3)}"))
        await verifier.aclose()
        return time.monotonic() - started
    assert asyncio.run(run()) < 10


def test_time_in_the_queue_never_cuts_a_run_short_and_nothing_runs_twice():
    # one worker, four programs of ~0.8 s each with a 1.5 s run timeout: the last waits ~2.4 s in the
    # queue, longer than a run's whole budget; each is started once and scored on its own run
    async def go(_, __):
        app = make_app(SandboxServerConfig(port=0, workers=1, sandbox=SandboxConfig(wall_timeout_s=2.0)))
        runner, url = await start(app)
        try:
            rows = [VerifyRequest(TaskItem(uid=f"s{i}", prompt="", answer=str(i), verifier="code_output"),
                                  f"\\boxed{{import time; time.sleep(0.8); print({i})}}") for i in range(4)]
            results = await verify([url], rows, run_timeout_s=1.5, request_margin_s=0.5, queue_timeout_s=10.0)
            return results, dict(app[SERVICE].stats)
        finally:
            await runner.cleanup()
    results, stats = asyncio.run(with_proxies(0, go))
    assert [r.status for r in results] == [VerifyStatus.OK] * 4, [r.details for r in results]
    assert stats["started"] == 4 and stats["expired_in_queue"] == 0
    assert SandboxServerConfig().workers == len(os.sched_getaffinity(0))  # workers default to the cores
