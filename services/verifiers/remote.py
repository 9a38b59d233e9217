"""Client for a SandboxFusion-style remote sandbox, and the `remote_sandbox` verifier on top.

Wire format (operations.md §3.1): `POST /run_code` takes `{code, language, compile_timeout,
run_timeout, memory_limit_MB, stdin, files}` and answers `{status: Success|Failed|SandboxError,
message, compile_result, run_result}`, each result `{status: Finished|TimeLimitExceeded|Error,
execution_time, return_code, stdout, stderr}`. `POST /submit` grades a completion against your own
stdin/stdout cases with `config.dataset_type="CommonOJDataset"` and `config.provided_data`.
`POST /run_tests` (threepo's own service, services/verifiers/sandbox_server.py) takes `{program,
tests, stdin, run_timeout, memory_limit_MB}` and runs the code_tests harness's two processes
(services/verifiers/harness.py): it answers like `/run_code`, the trusted side's report in
`run_result.stdout`. A service without it (SandboxFusion itself) answers 404: code_tests items need
threepo's service, code_output items run on either.

How it calls (operations.md §3.4, §3.6):
- every HTTP call holds the injected limiter (`async with limiter:`) while it is on the wire, never
  while it waits; the default is a per-process `asyncio.Semaphore` of `process_concurrency`,
  `threepo.deploy.limiter.ClusterLimiter` is cluster-wide;
- a request may wait for a worker at the service `queue_timeout_s` (header `X-Threepo-Start-By-S`:
  started by then or answered 504 unrun); its deadline is that + compile + run timeout + margin, so
  queueing never cuts a run short; past it (a hanging endpoint) it is retried on the next endpoint;
- transient failures are retried, with capped exponential backoff and jitter: transport errors,
  timeouts, HTTP 5xx, an unreadable body and `status: SandboxError` (a sandbox-side failure, not
  a run). Never retried: HTTP 4xx (our request is wrong: `infra_error` at once; 401/403, a refused
  token, raises `SandboxAuthError`), and any completed run, whatever its outcome;
- a circuit breaker per endpoint: `unhealthy_after` consecutive failures open it for `cooldown_s`;
  then one request (the half-open probe) may try it: success closes it, failure re-opens it. Calls
  that find every endpoint open wait for a probe instead of failing;
- how a call ends when it cannot get an answer. While some endpoint keeps answering other
  requests, failures are this request's own: after `max_attempts` of them it is a
  `SandboxInfraError`, which the verifier turns into `infra_error` with a NaN reward, never 0.
  While no endpoint answers anything, attempts are not counted: the call waits (a flaky or briefly
  down service is waited out) until no endpoint has answered for `outage_s`, then raises
  `VerifierOutage` (services/verifiers/base.py), which the verifier pool and the Ray actor pass on
  to the driver: every endpoint is really down, and the run should stop cleanly and resume later.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, AsyncContextManager

import aiohttp

from threepo.services.errors import UserInputError
from threepo.services.verifiers.base import VerifierOutage
from threepo.services.verifiers.code_verifiers import prepare, result, score_run
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig
from threepo.services.verifiers.sandbox_wire import (START_BY_HEADER, RunCodeResponse, SandboxInfraError, SubmitResult,
                                                     parse_run_code, to_run_result)
from threepo.services.wire.messages import VerifyRequest, VerifyResult, VerifyStatus


class SandboxAuthError(UserInputError):
    """HTTP 401/403: the sandbox refuses our token, for every request alike; a setup mistake to
    fix (`sandbox.auth_env`), raised rather than scored, like the other input errors."""


class _Retryable(Exception):
    pass


@dataclass
class _Endpoint:
    """One endpoint's circuit breaker: closed (`open_until` None), open, or half-open once
    `open_until` has passed, when one probe request (`probing`) may try it."""

    url: str
    failures: int = 0  # consecutive
    open_until: float | None = None
    probing: bool = False


class SandboxClient:
    """Calls `/run_code` and `/submit` on a pool of endpoints under a shared concurrency cap.

    `clock` and `sleep` (monotonic seconds, async sleep) are injectable so tests can follow the
    waiting without doing it; request deadlines are aiohttp's and always real."""

    def __init__(self, config: RemoteSandboxConfig | None = None,
                 limiter: AsyncContextManager | None = None, *, token: str = "",
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        self.config, self._token = config or RemoteSandboxConfig(), token
        self.limiter = limiter or asyncio.Semaphore(self.config.process_concurrency)
        self._endpoints = [_Endpoint(url.rstrip("/")) for url in self.config.endpoints]
        self._next = 0
        self._rng = random.Random(self.config.seed)
        self._clock, self._sleep = clock, sleep
        self._last_answer = clock()  # when an endpoint last answered (any request)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.attempts = 0  # HTTP requests sent, retries included (for metrics and tests)

    def healthy_endpoints(self) -> list[str]:
        """Endpoints whose breaker is closed."""
        return [e.url for e in self._endpoints if e.open_until is None]

    async def run_code(self, code: str, language: str = "python", stdin: str | None = None,
                       files: dict[str, bytes] | None = None) -> RunCodeResponse:
        cfg = self.config
        payload = {"code": code, "language": language,
                   "compile_timeout": cfg.compile_timeout_s, "run_timeout": cfg.run_timeout_s,
                   "memory_limit_MB": cfg.memory_limit_mb, "stdin": stdin,
                   "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
                   "fetch_files": []}
        return parse_run_code(await self._post("/run_code", payload))

    async def run_tests(self, program: str, tests: tuple[str, ...], stdin: str) -> RunCodeResponse:
        """The code_tests harness on the service: `program` in its sandbox, `tests` in a trusted process."""
        cfg = self.config
        payload = {"program": program, "tests": list(tests), "stdin": stdin, "run_timeout": cfg.run_timeout_s,
                   "memory_limit_MB": cfg.memory_limit_mb}
        return parse_run_code(await self._post("/run_tests", payload))

    async def submit(self, completion: str, cases: list[tuple[str, str]], uid: str = "0",
                     language: str = "python") -> SubmitResult:
        """Grade `completion` against `(stdin, expected stdout)` cases (CommonOJDataset)."""
        cfg = self.config
        provided = {"id": uid, "test": [{"input": {"stdin": i}, "output": {"stdout": o}}
                                        for i, o in cases]}
        payload = {"dataset": "threepo", "id": uid, "completion": completion,
                   "config": {"dataset_type": "CommonOJDataset", "language": language,
                              "compile_timeout": cfg.compile_timeout_s,
                              "run_timeout": cfg.run_timeout_s, "provided_data": provided,
                              "extra": {}}}
        body = await self._post("/submit", payload)
        if not isinstance(body, dict) or "accepted" not in body or "tests" not in body:
            raise SandboxInfraError(f"/submit: expected an EvalResult, got {body!r:.200}")
        for test in body["tests"]:
            info = parse_run_code(test.get("exec_info") or {"status": "SandboxError"})
            if info.status == "SandboxError":
                raise SandboxInfraError(f"/submit: a test case hit a sandbox error: {info.message}")
        return SubmitResult(bool(body["accepted"]), tuple(bool(t["passed"]) for t in body["tests"]),
                            body.get("extracted_code") or "")

    def backoff_s(self, retry: int) -> float:
        """Delay before retry `retry` (0-based): capped exponential, shortened by up to `jitter`."""
        cfg = self.config
        return min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** retry) * (1 - cfg.jitter * self._rng.random())

    async def _post(self, path: str, payload: dict[str, Any]) -> Any:
        cfg = self.config
        deadline = cfg.queue_timeout_s + cfg.compile_timeout_s + cfg.run_timeout_s + cfg.request_margin_s
        started, retries, charged = self._clock(), 0, 0
        while True:
            endpoint = await self._endpoint(started)
            try:
                body = await self._attempt(endpoint, path, payload, deadline)
            except (aiohttp.ClientError, asyncio.TimeoutError, _Retryable) as e:
                self._failed(endpoint)
                charged += self._last_answer > started  # others got answers meanwhile: ours is the problem
                if charged >= cfg.max_attempts:
                    raise SandboxInfraError(f"{path}: {charged} failed attempts while the service answered "
                                            f"other requests; last error: {type(e).__name__}: {e}") from None
                await self._sleep(self.backoff_s(retries))
                retries += 1
                continue
            except BaseException:  # cancelled (or a bug): the endpoint is not at fault, let another probe
                endpoint.probing = False
                raise
            self._answered(endpoint)
            return body

    async def _endpoint(self, started: float) -> _Endpoint:
        """The next endpoint to try: a closed one in round-robin, else an open one due for its
        half-open probe; when there is none, wait, up to the outage bound."""
        cfg = self.config
        while True:
            now = self._clock()
            closed = [e for e in self._endpoints if e.open_until is None]
            if closed:
                self._next += 1
                return closed[self._next % len(closed)]
            # every breaker is open: past the bound this is an outage, whether or not a probe is due
            # (a retry's backoff can outlast the cooldown, so a probe is always due by then)
            silent = now - max(self._last_answer, started)
            if silent >= cfg.outage_s:
                raise VerifierOutage(f"no sandbox endpoint answered for {silent:.0f}s (outage_s="
                                     f"{cfg.outage_s:g}): {list(cfg.endpoints)}")
            due = [e for e in self._endpoints if not e.probing and e.open_until <= now]
            if due:
                due[0].probing = True
                return due[0]
            waits = [e.open_until - now for e in self._endpoints if not e.probing]
            await self._sleep(max(0.01, min(waits + [0.1, cfg.outage_s - silent])))

    def _failed(self, endpoint: _Endpoint) -> None:
        now = self._clock()
        if endpoint.probing:  # the half-open probe failed: open again
            endpoint.probing, endpoint.open_until = False, now + self.config.cooldown_s
            return
        endpoint.failures += 1
        if endpoint.failures >= self.config.unhealthy_after and endpoint.open_until is None:
            endpoint.open_until, endpoint.failures = now + self.config.cooldown_s, 0

    def _answered(self, endpoint: _Endpoint) -> None:
        endpoint.failures, endpoint.open_until, endpoint.probing = 0, None, False
        self._last_answer = self._clock()

    async def _attempt(self, endpoint: _Endpoint, path: str, payload: dict[str, Any], deadline: float) -> Any:
        url, headers = endpoint.url + path, {START_BY_HEADER: f"{self.config.queue_timeout_s:g}"}
        if self._token:
            headers[self.config.auth_header] = f"Bearer {self._token}"
        session = self._ensure_session()
        async with self.limiter:
            self.attempts += 1
            async with session.post(url, json=payload, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=deadline)) as resp:
                if resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status} from {url}")
                text = await resp.text()
                if resp.status >= 400:  # the endpoint answered: our request is wrong, retrying cannot help
                    self._answered(endpoint)
                    if resp.status in (401, 403):
                        raise SandboxAuthError(f"HTTP {resp.status} from {url}: the sandbox refused our token; "
                                               "expected sandbox.auth_env to name a variable holding its token")
                    if resp.status == 404 and path == "/run_tests":
                        raise UserInputError(f"verifier remote_sandbox: {url} has no /run_tests (HTTP 404); "
                                             "code_tests items need threepo's sandbox service (python -m "
                                             "threepo.services.verifiers.sandbox_server)")
                    raise SandboxInfraError(f"HTTP {resp.status} from {url}: {text[:200]}")
        try:
            body = json.loads(text)
        except ValueError as e:
            raise _Retryable(f"unreadable body from {url}: {e}") from e
        if isinstance(body, dict) and body.get("status") == "SandboxError":
            raise _Retryable(f"SandboxError from {url}: {body.get('message', '')}")
        return body

    def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session, self._loop = aiohttp.ClientSession(), loop
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None

    def close(self) -> None:
        """Drop the HTTP session; prefer `await aclose()` inside a running loop."""
        session, loop, self._session = self._session, self._loop, None
        if session is None or session.closed or loop is None or loop.is_closed():
            return
        if loop.is_running():
            loop.create_task(session.close())
        else:
            loop.run_until_complete(session.close())


class RemoteSandboxVerifier:
    """`remote_sandbox`: `code_output` semantics (`/run_code`), or `code_tests` (the same two-process
    harness, through `/run_tests`, its token sent as the trusted side's stdin) when the item has tests
    (every `code_tests` item has), executed by a remote sandbox service. `options` are
    `RemoteSandboxConfig` fields (services/verifiers/sandbox_config.py); `token` is the bearer token
    (`RemoteSandboxConfig.token()` reads it where the run starts)."""

    name = "remote_sandbox"

    def __init__(self, config: RemoteSandboxConfig | None = None,
                 limiter: AsyncContextManager | None = None, *, token: str = "", **options: Any) -> None:
        if config is not None and options:
            raise ValueError("remote_sandbox: pass either `config` or its fields, not both")
        self.client = SandboxClient(config or RemoteSandboxConfig(**options), limiter, token=token)

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        start = time.monotonic()
        prepared, early = prepare(request, bool(request.item.tests))  # a code_tests item always has tests
        if early is not None:
            return early
        try:
            if prepared.tests:
                response = await self.client.run_tests(prepared.code, prepared.tests, prepared.token)
            else:
                response = await self.client.run_code(prepared.code, stdin=prepared.stdin)
        except SandboxInfraError as e:
            return result(VerifyStatus.INFRA_ERROR, str(e)[:300], start)
        compiled = response.compile_result
        if compiled is not None and (compiled.status != "Finished" or compiled.return_code != 0):
            return result(VerifyStatus.COMPILE_ERROR, compiled.stderr[-300:], start)
        return score_run(to_run_result(response), prepared.expected, start, prepared.token)

    async def aclose(self) -> None:
        await self.client.aclose()

    def close(self) -> None:
        self.client.close()
