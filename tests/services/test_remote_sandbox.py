"""The remote sandbox client against the sandbox server on loopback, with faults injected in
front of it: retried where safe, `infra_error` (NaN) otherwise, never reward 0."""

import asyncio
import math
import shutil
import socket
import time

import pytest
from aiohttp import web

from threepo.services.verifiers.base import VerifierOutage, load_verifier
from threepo.services.verifiers.remote import RemoteSandboxVerifier, SandboxAuthError, SandboxClient
from threepo.services.verifiers.sandbox import SandboxConfig
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig
from threepo.services.verifiers.sandbox_server import SandboxServerConfig, make_app
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyStatus

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap missing: apt-get install -y bubblewrap")

ITEM = TaskItem(uid="t", prompt="Q: print 12 times 7 A: ", answer="84", verifier="code_output")


class Faults:
    """Plays one action per request: ok, 500, 503, hang, slow, garbage, sandbox_error."""

    def __init__(self, *plan: str) -> None:
        self.plan, self.seen = list(plan), 0
        self.release = asyncio.Event()  # set at teardown so hung handlers end with the test

    @web.middleware
    async def middleware(self, request, handler):
        action = self.plan[min(self.seen, len(self.plan) - 1)]
        self.seen += 1
        if action in ("400", "404", "500", "503"):
            return web.Response(status=int(action), text="injected")
        if action == "hang":
            await asyncio.wait_for(self.release.wait(), timeout=30)
            return web.Response(status=599, text="released")
        if action == "slow":
            await asyncio.sleep(0.3)
        if action == "garbage":
            return web.Response(text="{not json")
        if action == "sandbox_error":
            return web.json_response({"status": "SandboxError", "message": "injected"})
        return await handler(request)


async def serve(faults: Faults | None = None, token: str = ""):
    config = SandboxServerConfig(port=0, workers=2, auth_token=token,
                                 sandbox=SandboxConfig(wall_timeout_s=2.0))
    app = make_app(config, middlewares=(faults.middleware,) if faults else ())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def client_config(url, **kw):
    base = dict(endpoints=(url,), compile_timeout_s=0.1, run_timeout_s=2.0, request_margin_s=1.0, queue_timeout_s=0.5,
                max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.05, cooldown_s=0.2, outage_s=5.0)
    return RemoteSandboxConfig(**{**base, **kw})


def verify_with(plan, completion="\\boxed{print(12*7)}", token="", item=ITEM, sent="", **kw):
    async def go():
        faults = Faults(*plan)
        runner, url = await serve(faults, token)
        try:
            verifier = RemoteSandboxVerifier(client_config(url, **kw), token=sent)
            r = await verifier.verify(VerifyRequest(item, completion))
            await verifier.aclose()
            return r, verifier.client.attempts
        finally:
            faults.release.set()
            await runner.cleanup()
    return asyncio.run(go())


@pytest.mark.parametrize("completion, status", [
    ("\\boxed{print(12*7)}", VerifyStatus.OK),
    ("\\boxed{print(12*8)}", VerifyStatus.WRONG),
    ("\\boxed{print(1/0)}", VerifyStatus.RUNTIME_ERROR),
    ("\\boxed{import time; time.sleep(10)}", VerifyStatus.TIMEOUT),
])
def test_remote_statuses_match_local_semantics_and_are_not_retried(completion, status):
    r, attempts = verify_with(["ok"], completion, run_timeout_s=0.5)
    assert r.status is status, r.details
    assert r.reward == (1.0 if status is VerifyStatus.OK else 0.0)
    assert attempts == 1  # a completed run is never retried, whatever its outcome


@pytest.mark.parametrize("plan", [["503", "500", "ok"], ["hang", "ok"], ["garbage", "ok"],
                                  ["sandbox_error", "ok"], ["slow"]])
def test_transient_faults_are_retried_to_success(plan):
    r, attempts = verify_with(plan, run_timeout_s=0.5)
    assert r.status is VerifyStatus.OK and r.reward == 1.0
    assert attempts == len(plan)


@pytest.mark.parametrize("plan", [["500"], ["hang"], ["sandbox_error"]])
def test_a_service_that_never_answers_is_an_outage_not_a_row_error(plan):
    # nothing answers: attempts are not held against the request; past outage_s the call raises
    start = time.monotonic()
    with pytest.raises(VerifierOutage, match="no sandbox endpoint answered"):
        verify_with(plan, run_timeout_s=0.3, request_margin_s=0.2, unhealthy_after=2, cooldown_s=0.2,
                    outage_s=1.5)
    assert 1.5 <= time.monotonic() - start < 10


@pytest.mark.parametrize("status", ["400", "404"])
def test_client_errors_4xx_are_not_retried(status):
    r, attempts = verify_with([status, "ok"])
    assert r.status is VerifyStatus.INFRA_ERROR and math.isnan(r.reward)
    assert attempts == 1 and status in r.details


def test_a_refused_token_is_a_setup_error_not_a_row_error():
    with pytest.raises(SandboxAuthError, match="HTTP 401 .* sandbox.auth_env"):
        verify_with(["ok"], token="s3cret")  # we send no token
    with pytest.raises(SandboxAuthError):
        verify_with(["ok"], token="s3cret", sent="wrong")
    r, attempts = verify_with(["ok"], token="s3cret", sent="s3cret")
    assert r.status is VerifyStatus.OK and attempts == 1


def test_code_tests_through_remote_and_load_by_name():
    item = TaskItem(uid="t2", prompt="", answer="", verifier="remote_sandbox",
                    tests=("assert f(3) == 9",))
    r, _ = verify_with(["ok"], "```python\ndef f(x):\n    return x * x\n```", item=item)
    assert r.status is VerifyStatus.OK
    r, _ = verify_with(["ok"], "```python\ndef f(x):\n    return x + x\n```", item=item)
    assert r.status is VerifyStatus.WRONG
    assert load_verifier("remote_sandbox", endpoints=["http://127.0.0.1:1"]).name == "remote_sandbox"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingLimiter:
    def __init__(self, cap):
        self.sem, self.in_flight, self.peak, self.entered = asyncio.Semaphore(cap), 0, 0, 0

    async def __aenter__(self):
        await self.sem.acquire()
        self.in_flight += 1
        self.entered += 1
        self.peak = max(self.peak, self.in_flight)

    async def __aexit__(self, *exc):
        self.in_flight -= 1
        self.sem.release()


def test_dead_endpoint_marked_unhealthy_and_limiter_bounds_concurrency():
    async def go():
        runner, url = await serve()
        dead = f"http://127.0.0.1:{free_port()}"
        limiter = CountingLimiter(2)
        client = SandboxClient(client_config(url, endpoints=(dead, url), unhealthy_after=1,
                                             cooldown_s=60.0), limiter)
        try:
            runs = await asyncio.gather(*[client.run_code("print(7)") for _ in range(6)])
            healthy = client.healthy_endpoints()
            submitted = await client.submit("```python\nprint(int(input()) * 2)\n```",
                                            [("2\n", "4"), ("5\n", "10")])
            rejected = await client.submit("\\boxed{print(4)}", [("2\n", "4"), ("5\n", "10")])
        finally:
            await client.aclose()
            await runner.cleanup()
        return runs, healthy, submitted, rejected, limiter
    runs, healthy, submitted, rejected, limiter = asyncio.run(go())
    assert all(r.status == "Success" and r.run_result.stdout == "7\n" for r in runs)
    assert healthy == [healthy[0]] and "127.0.0.1" in healthy[0] and len(healthy) == 1
    assert limiter.peak <= 2 and limiter.entered >= 6
    assert submitted.accepted and submitted.passed == (True, True)
    assert not rejected.accepted and rejected.passed == (True, False)


def test_server_rejects_bad_requests_with_400():
    async def go():
        runner, url = await serve()
        import aiohttp
        try:
            async with aiohttp.ClientSession() as s:
                bad_lang = await s.post(url + "/run_code", json={"code": "1", "language": "cpp"})
                bad_json = await s.post(url + "/run_code", data="{nope")
                ping = await s.get(url + "/v1/ping")
                return bad_lang.status, bad_json.status, await ping.text()
        finally:
            await runner.cleanup()
    assert asyncio.run(go()) == (400, 400, "pong")


def test_stdin_and_files_travel_over_http():
    async def go():
        runner, url = await serve()
        client = SandboxClient(client_config(url))
        try:
            return await client.run_code("print(input() + open('d/x.txt').read())", stdin="ab\n",
                                         files={"d/x.txt": b"cd"})
        finally:
            await client.aclose()
            await runner.cleanup()
    response = asyncio.run(go())
    assert response.status == "Success" and response.run_result.stdout == "abcd\n"
