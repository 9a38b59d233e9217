"""A sandbox service speaking the SandboxFusion-style API, built on `LocalSandbox`.

Endpoints (operations.md §3.1): `POST /run_code` (Python only), `POST /submit` with
`config.dataset_type="CommonOJDataset"` and the cases in `config.provided_data.test`, threepo's own
`POST /run_tests` (`{program, tests, stdin, run_timeout, memory_limit_MB}`: the code_tests harness,
the program in the sandbox and the tests in a trusted process, services/verifiers/harness.py;
answered like `/run_code`), `GET /v1/ping`, and `GET /v1/info` (the interpreter programs run on, as
they see it, and the queue). At most `workers` programs run at once (default: the machine's cores); the rest queue.

- A malformed request is answered 400 with one line naming the field and what was expected (a
  string timeout, a float memory limit, a number for stdin, a list for files, ...); so is a
  language other than Python. Clients must not retry a 400 (threepo's does not).
- Queued work whose client is gone is dropped before it runs: a client that disconnects cancels
  its handler (`handler_cancellation`, which also kills a program it is running), and a request
  carrying `X-Threepo-Start-By-S` (seconds within which it must start; threepo's client sends it and
  waits that long plus the run's own timeouts, so a program that starts is always awaited) that is
  still queued when it passes is answered 504 without running. The run's timeout starts when the
  program does: time in the queue never cuts it short.
- The sandbox failing to start a program is `status: SandboxError` (the client retries that, and
  turns it into `infra_error`).
- Programs run on `SandboxConfig.python` (`--python`; default: the interpreter running the
  server), inside the filesystem services/verifiers/sandbox.py describes.

Run it as the cluster's verifier service:
    python -m threepo.services.verifiers.sandbox_server --host 0.0.0.0 --port 8080
with the token, if any, in the environment variable THREEPO_SANDBOX_TOKEN.

Not implemented: other languages, registered datasets, `AutoEvalDataset`, `/run_jupyter`,
`fetch_files` (answered with an empty `files` map).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from threepo.services.verifiers.code_verifiers import extract_program, normalize_output
from threepo.services.verifiers.sandbox import (OUTPUT_LIMIT_MESSAGE, LocalSandbox, RunResult, RunStatus,
                                                SandboxConfig, SandboxUnavailableError)
from threepo.services.verifiers.sandbox_wire import START_BY_HEADER
from threepo.services.verifiers.split_run import run_tests

_RUN_STATUS = {RunStatus.FINISHED: "Finished", RunStatus.TIMEOUT: "TimeLimitExceeded",
               RunStatus.OUTPUT_LIMIT: "Error"}


@dataclass(frozen=True)
class SandboxServerConfig:
    """The service's bind address, worker count and per-request caps."""

    host: str = "127.0.0.1"
    """Bind address; 0.0.0.0 only behind a network policy (the service runs untrusted code)."""
    port: int = 8080
    """TCP port (0: pick a free one)."""
    workers: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    """Programs running at once (default: the cores this process may use); further requests wait."""
    max_run_timeout_s: float = 30.0
    """Upper bound on a request's `run_timeout`."""
    max_memory_mb: int = 4096
    """Upper bound on a request's `memory_limit_MB`."""
    auth_token: str = ""
    """When set, requests must carry `Authorization: Bearer <auth_token>`."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Default limits of each run."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"SandboxServerConfig.workers: expected >= 1, got {self.workers}")


_NUMBER, _INT, _STR = ("a number", (int, float)), ("an integer", (int,)), ("a string", (str,))


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=message, content_type="text/plain")


def field_of(body: dict[str, Any], name: str, kind: tuple[str, tuple[type, ...]], where: str,
             required: bool = False) -> Any:
    """`body[name]` if it has the expected type (booleans are never numbers), None if absent or
    null and not required; else a 400 naming `where.name` and what was expected."""
    expected, types = kind
    value = body.get(name)
    if value is None:
        if required:
            raise _bad_request(f"{where}: field `{name}` is required ({expected})")
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        raise _bad_request(f"{where}: field `{name}`: expected {expected}, got "
                           f"{type(value).__name__} {value!r:.40}")
    return value


def _limits(body: dict[str, Any], where: str) -> tuple[float | None, int | None]:
    """(run_timeout, memory_limit_MB) of a request, checked; compile_timeout is checked and unused
    (Python is not compiled ahead)."""
    field_of(body, "compile_timeout", _NUMBER, where)
    timeout = field_of(body, "run_timeout", _NUMBER, where)
    if timeout is not None and not timeout > 0:
        raise _bad_request(f"{where}: field `run_timeout`: expected a number > 0, got {timeout!r}")
    return timeout, field_of(body, "memory_limit_MB", _INT, where)


def _files(body: dict[str, Any]) -> dict[str, bytes]:
    files = body.get("files")
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise _bad_request(f"run_code: field `files`: expected an object of path -> base64 string, "
                           f"got {type(files).__name__}")
    out = {}
    for name, content in files.items():
        if not isinstance(content, str):
            raise _bad_request(f"run_code: field `files.{name}`: expected a base64 string, got "
                               f"{type(content).__name__}")
        try:
            out[name] = base64.b64decode(content, validate=True)
        except ValueError as e:
            raise _bad_request(f"run_code: field `files.{name}`: expected base64 ({e})")
    return out


def run_code_body(run: RunResult, message: str = "") -> dict[str, Any]:
    """A `RunCodeResponse` for one local run."""
    if run.status is RunStatus.SANDBOX_ERROR:
        return {"status": "SandboxError", "message": message or run.stderr[-500:],
                "compile_result": None, "run_result": None, "files": {}}
    ok = run.status is RunStatus.FINISHED and run.return_code == 0
    if run.status is RunStatus.OUTPUT_LIMIT:
        message = message or OUTPUT_LIMIT_MESSAGE
    return {"status": "Success" if ok else "Failed", "message": message, "compile_result": None,
            "run_result": {"status": _RUN_STATUS[run.status], "execution_time": run.execution_time,
                           "return_code": run.return_code, "stdout": run.stdout,
                           "stderr": run.stderr},
            "executor_pod_name": socket.gethostname(), "files": {}}


class SandboxService:
    """Request handling, separate from the aiohttp wiring so it can be called directly."""

    def __init__(self, config: SandboxServerConfig, sandbox: LocalSandbox | None = None) -> None:
        self.config = config
        # the sandbox's own cap must not be what limits the workers
        self.sandbox = sandbox or LocalSandbox(replace(config.sandbox, max_parallel=max(config.sandbox.max_parallel,
                                                                                        config.workers)))
        self._slots = asyncio.Semaphore(config.workers)
        # programs started; queued requests dropped because their start-by time passed or client left
        self.stats = {"started": 0, "expired_in_queue": 0, "cancelled_in_queue": 0, "queued": 0}

    async def _slot(self, deadline: float | None) -> None:
        """Wait for a free worker, but not past the request's start-by time (monotonic), nor after the
        client has gone (the handler is then cancelled here)."""
        self.stats["queued"] += 1
        acquiring = asyncio.ensure_future(self._slots.acquire())
        try:
            await asyncio.wait([acquiring], timeout=None if deadline is None
                               else max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:
            self.stats["cancelled_in_queue"] += 1
            self._drop(acquiring)
            raise
        finally:
            self.stats["queued"] -= 1
        if not acquiring.done():
            self.stats["expired_in_queue"] += 1
            self._drop(acquiring)
            raise web.HTTPGatewayTimeout(text="the request's start-by time passed while it was "
                                              "queued; it was not run")

    def _drop(self, acquiring: asyncio.Future) -> None:
        """Abandon a wait for a worker, giving back the permit if it was granted meanwhile."""
        if acquiring.done() and not acquiring.cancelled():
            self._slots.release()
        else:
            acquiring.cancel()  # Semaphore.acquire hands on a permit granted while cancelling

    async def execute(self, code: str, stdin: str | None, files: dict[str, bytes],
                      run_timeout: float | None, memory_mb: int | None,
                      deadline: float | None = None, tests: tuple[str, ...] = ()) -> dict[str, Any]:
        """One run (with `tests`: the code_tests harness, `stdin` its token) in a free worker."""
        timeout = min(run_timeout or self.config.sandbox.wall_timeout_s,
                      self.config.max_run_timeout_s)
        memory = None if not memory_mb or memory_mb < 0 else min(memory_mb,
                                                                  self.config.max_memory_mb)
        await self._slot(deadline)
        try:
            self.stats["started"] += 1
            try:
                if tests:
                    run = await run_tests(self.sandbox, code, tests, stdin or "", timeout_s=timeout,
                                          memory_bytes=memory and memory << 20)
                else:
                    run = await self.sandbox.run(code, stdin=stdin, files=files, timeout_s=timeout,
                                                 memory_bytes=memory and memory << 20)
            except SandboxUnavailableError as e:
                return run_code_body(RunResult(RunStatus.SANDBOX_ERROR, None, "", "", 0.0), str(e))
        finally:
            self._slots.release()
        return run_code_body(run)

    async def run_code(self, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        code = field_of(body, "code", _STR, "run_code", required=True)
        language = field_of(body, "language", _STR, "run_code") or "python"
        if language != "python":
            raise _bad_request(f"run_code: field `language`: {language!r} unsupported; expected 'python'")
        stdin = field_of(body, "stdin", _STR, "run_code")
        run_timeout, memory_mb = _limits(body, "run_code")
        fetch = body.get("fetch_files")
        if fetch is not None and not (isinstance(fetch, list) and all(isinstance(f, str) for f in fetch)):
            raise _bad_request("run_code: field `fetch_files`: expected a list of strings")
        files = _files(body)
        try:
            return await self.execute(code, stdin, files, run_timeout, memory_mb, deadline)
        except ValueError as e:  # a file path outside the working directory
            raise _bad_request(f"run_code: field `files`: {e}")

    async def run_tests(self, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        program = field_of(body, "program", _STR, "run_tests", required=True)
        tests = field_of(body, "tests", ("a list of strings", (list,)), "run_tests", required=True)
        if not tests or not all(isinstance(t, str) for t in tests):
            raise _bad_request("run_tests: field `tests`: expected a non-empty list of strings (test statements)")
        token = field_of(body, "stdin", _STR, "run_tests", required=True)
        run_timeout, memory_mb = _limits(body, "run_tests")
        return await self.execute(program, token, {}, run_timeout, memory_mb, deadline, tests=tuple(tests))

    async def submit(self, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        completion = field_of(body, "completion", _STR, "submit", required=True)
        config = field_of(body, "config", ("an object", (dict,)), "submit", required=True)
        if config.get("dataset_type") != "CommonOJDataset":
            raise _bad_request("submit: field `config.dataset_type`: expected 'CommonOJDataset'")
        if (field_of(config, "language", _STR, "submit: config") or "python") != "python":
            raise _bad_request("submit: field `config.language`: expected 'python'")
        run_timeout, _ = _limits(config, "submit: config")
        provided = field_of(config, "provided_data", ("an object", (dict,)), "submit: config", required=True)
        cases = field_of(provided, "test", ("a list", (list,)), "submit: config.provided_data", required=True)
        for i, case in enumerate(cases):
            where = f"submit: config.provided_data.test[{i}]"
            if not isinstance(case, dict):
                raise _bad_request(f"{where}: expected an object {{input: {{stdin}}, output: {{stdout}}}}")
            field_of(field_of(case, "input", ("an object", (dict,)), where, True), "stdin", _STR, where + ".input")
            field_of(field_of(case, "output", ("an object", (dict,)), where, True), "stdout", _STR, where + ".output")
        code = extract_program(completion)
        tests = []
        for case in cases if code is not None else []:
            info = await self.execute(code, case["input"].get("stdin"), {}, run_timeout, None, deadline)
            run = info["run_result"]
            passed = (info["status"] == "Success"
                      and normalize_output(run["stdout"]) == normalize_output(
                          case["output"].get("stdout", "")))
            tests.append({"passed": passed, "exec_info": info, "test_info": case})
        return {"id": body.get("id"), "accepted": bool(tests) and all(t["passed"] for t in tests),
                "extracted_code": code or "", "full_code": code or "", "test_code": None,
                "tests": tests, "extracted_type": "python" if code is not None else None}


SERVICE = web.AppKey("threepo_sandbox_service", SandboxService)


def make_app(config: SandboxServerConfig, sandbox: LocalSandbox | None = None,
             middlewares: tuple = ()) -> web.Application:
    """The aiohttp application (extra `middlewares` let tests inject faults in front)."""
    service = SandboxService(config, sandbox)

    @web.middleware
    async def auth(request: web.Request, handler):
        expected = f"Bearer {config.auth_token}"
        if config.auth_token and request.headers.get("Authorization") != expected:
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")
        return await handler(request)

    def deadline_of(request: web.Request) -> float | None:
        raw = request.headers.get(START_BY_HEADER)
        if raw is None:
            return None
        try:
            return time.monotonic() + float(raw)
        except ValueError:
            raise _bad_request(f"header {START_BY_HEADER}: expected seconds as a number, got {raw!r:.40}")

    async def json_body(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as e:
            raise _bad_request(f"request body is not JSON: {e}")
        if not isinstance(body, dict):
            raise _bad_request("request body must be a JSON object")
        return body

    async def run_code(request: web.Request) -> web.Response:
        return web.json_response(await service.run_code(await json_body(request), deadline_of(request)))

    async def submit(request: web.Request) -> web.Response:
        return web.json_response(await service.submit(await json_body(request), deadline_of(request)))

    async def run_tests_route(request: web.Request) -> web.Response:
        return web.json_response(await service.run_tests(await json_body(request), deadline_of(request)))

    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"interpreter": await service.sandbox.interpreter(),
                                  "workers": config.workers, **service.stats})

    app = web.Application(middlewares=[*middlewares, auth])
    app.add_routes([web.post("/run_code", run_code), web.post("/submit", submit), web.post("/run_tests", run_tests_route),
                    web.get("/v1/ping", ping), web.get("/v1/info", info)])
    app[SERVICE] = service
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="threepo sandbox service (SandboxFusion API)")
    parser.add_argument("--host", default=SandboxServerConfig.host)
    parser.add_argument("--port", type=int, default=SandboxServerConfig.port)
    parser.add_argument("--workers", type=int, default=None, help="programs at once (default: the cores)")
    parser.add_argument("--unconfined", action="store_true",
                        help="run WITHOUT namespace isolation (unsafe; logged loudly)")
    parser.add_argument("--python", default=SandboxConfig().python,
                        help="interpreter the programs run on (default: this one)")
    args = parser.parse_args(argv)
    sandbox = SandboxConfig(isolation="unconfined" if args.unconfined else "bwrap", python=args.python)
    config = SandboxServerConfig(host=args.host, port=args.port, **({"workers": args.workers} if args.workers else {}),
                                 auth_token=os.environ.get("THREEPO_SANDBOX_TOKEN", ""),
                                 sandbox=sandbox)
    app = make_app(config)

    async def announce(app: web.Application) -> None:
        print(f"threepo sandbox: programs run on {await app[SERVICE].sandbox.interpreter()}", flush=True)

    app.on_startup.append(announce)
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True)


if __name__ == "__main__":
    main()
