"""Client for a SandboxFusion-style remote sandbox, and the `remote_sandbox` verifier on top.

Wire format (operations.md §3.1): `POST /run_code` takes `{code, language, compile_timeout,
run_timeout, memory_limit_MB, stdin, files}` and answers `{status: Success|Failed|SandboxError,
message, compile_result, run_result}`, each result `{status: Finished|TimeLimitExceeded|Error,
execution_time, return_code, stdout, stderr}`. `POST /submit` grades a completion against your own
stdin/stdout cases with `config.dataset_type="CommonOJDataset"` and `config.provided_data`.

How it calls (operations.md §3.4, §7 item 6):
- every HTTP call holds the injected limiter (`async with limiter:`); the default is a
  per-process `asyncio.Semaphore`, `threepo.deploy.limiter.ClusterLimiter` is cluster-wide;
- per-request deadline = compile_timeout + run_timeout + request_margin;
- retried with exponential backoff and jitter: transport errors, timeouts, HTTP 5xx, an
  unreadable body and `status: SandboxError` (a sandbox-side failure, not a run). Never retried:
  HTTP 4xx, and any completed run, whatever its outcome;
- endpoints in round-robin; `unhealthy_after` consecutive failures take one out for `cooldown_s`;
- everything that is not the program's fault ends as `SandboxInfraError`, which the verifier
  turns into `infra_error` with a NaN reward, never 0.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from dataclasses import dataclass, fields
from typing import Any, AsyncContextManager

import aiohttp

from threepo.services.messages import VerifyRequest, VerifyResult, VerifyStatus
from threepo.services.verifiers.code_verifiers import prepare, result, score_run
from threepo.services.verifiers.sandbox import RunResult, RunStatus


@dataclass(frozen=True)
class RemoteSandboxConfig:
    """Where the sandbox service is and how to call it."""

    endpoints: tuple[str, ...] = ("http://127.0.0.1:8080",)
    """Base URLs, used round-robin (e.g. `http://sandbox.verifier.svc:8080`)."""
    compile_timeout_s: float = 10.0
    """Sent as `compile_timeout`."""
    run_timeout_s: float = 10.0
    """Sent as `run_timeout`."""
    memory_limit_mb: int = -1
    """Sent as `memory_limit_MB` (-1: the server's default)."""
    request_margin_s: float = 10.0
    """Added to compile + run timeout to give each HTTP request's deadline."""
    max_attempts: int = 5
    """Attempts per call, the first included."""
    backoff_base_s: float = 0.5
    """Delay before retry k (k = 0, 1, ...) is min(backoff_max_s, base * 2**k) * U(0.5, 1)."""
    backoff_max_s: float = 10.0
    """Cap on one backoff delay."""
    unhealthy_after: int = 3
    """Consecutive failures after which an endpoint is taken out of rotation."""
    cooldown_s: float = 30.0
    """How long an unhealthy endpoint stays out before it is tried again."""
    max_concurrency: int = 64
    """Size of the default per-process semaphore (ignored when a limiter is injected)."""
    auth_token: str = ""
    """Sent as `<auth_header>: Bearer <auth_token>` when set."""
    auth_header: str = "Authorization"
    """Header that carries the token."""
    seed: int = 0
    """Seed of the backoff jitter."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", tuple(self.endpoints))
        if not self.endpoints or not all(e.startswith(("http://", "https://"))
                                         for e in self.endpoints):
            raise ValueError(f"RemoteSandboxConfig.endpoints: expected http(s) URLs, "
                             f"got {self.endpoints!r}")
        for name in ("max_attempts", "unhealthy_after", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"RemoteSandboxConfig.{name}: expected >= 1, "
                                 f"got {getattr(self, name)}")
        for name in ("compile_timeout_s", "run_timeout_s", "request_margin_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RemoteSandboxConfig.{name}: expected > 0")


class SandboxInfraError(RuntimeError):
    """The remote sandbox could not give an answer about the program."""


class _Retryable(Exception):
    pass


@dataclass(frozen=True)
class CommandResult:
    """`compile_result` / `run_result` of a `/run_code` response."""

    status: str  # Finished | TimeLimitExceeded | Error
    execution_time: float | None
    return_code: int | None
    stdout: str
    stderr: str


@dataclass(frozen=True)
class RunCodeResponse:
    status: str  # Success | Failed | SandboxError
    message: str
    compile_result: CommandResult | None
    run_result: CommandResult | None


@dataclass(frozen=True)
class SubmitResult:
    """The parts of an `EvalResult` we use: overall verdict and one verdict per test case."""

    accepted: bool
    passed: tuple[bool, ...]
    extracted_code: str


def _command(raw: dict[str, Any] | None, where: str) -> CommandResult | None:
    if raw is None:
        return None
    missing = {f.name for f in fields(CommandResult)} - set(raw)
    if missing:
        raise SandboxInfraError(f"{where}: response lacks {sorted(missing)}")
    return CommandResult(raw["status"], raw["execution_time"], raw["return_code"],
                         raw["stdout"] or "", raw["stderr"] or "")


def parse_run_code(body: dict[str, Any]) -> RunCodeResponse:
    """Typed view of a `/run_code` body; a body missing fields is an infrastructure error."""
    if not isinstance(body, dict) or "status" not in body:
        raise SandboxInfraError(f"/run_code: expected an object with `status`, got {body!r:.200}")
    return RunCodeResponse(body["status"], body.get("message", ""),
                           _command(body.get("compile_result"), "compile_result"),
                           _command(body.get("run_result"), "run_result"))


def to_run_result(response: RunCodeResponse) -> RunResult:
    """Map a response onto the local sandbox's outcome, so both are scored by `score_run`."""
    run = response.run_result
    if response.status == "SandboxError" or run is None:
        return RunResult(RunStatus.SANDBOX_ERROR, None, "", response.message, 0.0)
    status = {"Finished": RunStatus.FINISHED,
              "TimeLimitExceeded": RunStatus.TIMEOUT}.get(run.status, RunStatus.FINISHED)
    code = run.return_code if run.status == "Finished" else (run.return_code or -1)
    return RunResult(status, code, run.stdout, run.stderr, run.execution_time or 0.0)


@dataclass
class _Endpoint:
    url: str
    failures: int = 0
    unhealthy_until: float = 0.0


class SandboxClient:
    """Calls `/run_code` and `/submit` on a pool of endpoints under a shared concurrency cap."""

    def __init__(self, config: RemoteSandboxConfig | None = None,
                 limiter: AsyncContextManager | None = None) -> None:
        self.config = config or RemoteSandboxConfig()
        self.limiter = limiter or asyncio.Semaphore(self.config.max_concurrency)
        self._endpoints = [_Endpoint(url.rstrip("/")) for url in self.config.endpoints]
        self._next = 0
        self._rng = random.Random(self.config.seed)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.attempts = 0  # HTTP requests sent, retries included (for metrics and tests)

    def healthy_endpoints(self) -> list[str]:
        now = time.monotonic()
        return [e.url for e in self._endpoints if e.unhealthy_until <= now]

    async def run_code(self, code: str, language: str = "python", stdin: str | None = None,
                       files: dict[str, bytes] | None = None) -> RunCodeResponse:
        cfg = self.config
        payload = {"code": code, "language": language,
                   "compile_timeout": cfg.compile_timeout_s, "run_timeout": cfg.run_timeout_s,
                   "memory_limit_MB": cfg.memory_limit_mb, "stdin": stdin,
                   "files": {k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
                   "fetch_files": []}
        return parse_run_code(await self._post("/run_code", payload))

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

    async def _post(self, path: str, payload: dict[str, Any]) -> Any:
        cfg = self.config
        deadline = cfg.compile_timeout_s + cfg.run_timeout_s + cfg.request_margin_s
        last: Exception | None = None
        for attempt in range(cfg.max_attempts):
            if attempt:
                delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + 0.5 * self._rng.random()))
            endpoint = self._pick()
            try:
                body = await self._attempt(endpoint.url + path, payload, deadline)
            except (aiohttp.ClientError, asyncio.TimeoutError, _Retryable) as e:
                last = e
                self._failed(endpoint)
                continue
            endpoint.failures = 0
            return body
        raise SandboxInfraError(f"{path}: gave up after {cfg.max_attempts} attempts; "
                                f"last error: {type(last).__name__}: {last}")

    async def _attempt(self, url: str, payload: dict[str, Any], deadline: float) -> Any:
        headers = {}
        if self.config.auth_token:
            headers[self.config.auth_header] = f"Bearer {self.config.auth_token}"
        session = self._ensure_session()
        async with self.limiter:
            self.attempts += 1
            async with session.post(url, json=payload, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=deadline)) as resp:
                if resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status} from {url}")
                text = await resp.text()
                if resp.status >= 400:  # our request is wrong: retrying cannot help
                    raise SandboxInfraError(f"HTTP {resp.status} from {url}: {text[:200]}")
        try:
            body = json.loads(text)
        except ValueError as e:
            raise _Retryable(f"unreadable body from {url}: {e}") from e
        if isinstance(body, dict) and body.get("status") == "SandboxError":
            raise _Retryable(f"SandboxError from {url}: {body.get('message', '')}")
        return body

    def _pick(self) -> _Endpoint:
        now = time.monotonic()
        for _ in range(len(self._endpoints)):
            endpoint = self._endpoints[self._next % len(self._endpoints)]
            self._next += 1
            if endpoint.unhealthy_until <= now:
                return endpoint
        raise SandboxInfraError(f"all sandbox endpoints unhealthy: {self.config.endpoints}")

    def _failed(self, endpoint: _Endpoint) -> None:
        endpoint.failures += 1
        if endpoint.failures >= self.config.unhealthy_after:
            endpoint.unhealthy_until = time.monotonic() + self.config.cooldown_s
            endpoint.failures = 0

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
    """`remote_sandbox`: `code_output` semantics, or `code_tests` when the item has tests,
    executed by a remote sandbox service. `options` are `RemoteSandboxConfig` fields."""

    name = "remote_sandbox"

    def __init__(self, config: RemoteSandboxConfig | None = None,
                 limiter: AsyncContextManager | None = None, **options: Any) -> None:
        if config is not None and options:
            raise ValueError("remote_sandbox: pass either `config` or its fields, not both")
        self.client = SandboxClient(config or RemoteSandboxConfig(**options), limiter)

    async def verify(self, request: VerifyRequest) -> VerifyResult:
        start = time.monotonic()
        with_tests = bool(request.item.tests)
        program, early = prepare(request, with_tests)
        if early is not None:
            return early
        try:
            response = await self.client.run_code(program)
        except SandboxInfraError as e:
            return result(VerifyStatus.INFRA_ERROR, str(e)[:300], start)
        compiled = response.compile_result
        if compiled is not None and (compiled.status != "Finished" or compiled.return_code != 0):
            return result(VerifyStatus.COMPILE_ERROR, compiled.stderr[-300:], start)
        return score_run(to_run_result(response), None if with_tests else request.item.answer,
                         start)

    async def aclose(self) -> None:
        await self.client.aclose()

    def close(self) -> None:
        self.client.close()
