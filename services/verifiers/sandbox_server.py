"""A sandbox service speaking the SandboxFusion-style API, built on `LocalSandbox`.

Endpoints (operations.md §3.1): `POST /run_code` (Python only), `POST /submit` with
`config.dataset_type="CommonOJDataset"` and the cases in `config.provided_data.test`, and
`GET /v1/ping`. At most `workers` programs run at once; the rest queue. A request for a language
other than Python, or a malformed request, is answered 400; the sandbox failing to start a
program is `status: SandboxError` (the client retries that, and turns it into `infra_error`).

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
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from threepo.services.verifiers.code_verifiers import extract_program, normalize_output
from threepo.services.verifiers.sandbox import (LocalSandbox, RunResult, RunStatus,
                                                SandboxConfig, SandboxUnavailableError)

_RUN_STATUS = {RunStatus.FINISHED: "Finished", RunStatus.TIMEOUT: "TimeLimitExceeded",
               RunStatus.OUTPUT_LIMIT: "Error"}


@dataclass(frozen=True)
class SandboxServerConfig:
    """The service's bind address, worker count and per-request caps."""

    host: str = "127.0.0.1"
    """Bind address; 0.0.0.0 only behind a network policy (the service runs untrusted code)."""
    port: int = 8080
    """TCP port (0: pick a free one)."""
    workers: int = 2
    """Programs running at once; further requests wait."""
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


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=message, content_type="text/plain")


def run_code_body(run: RunResult, message: str = "") -> dict[str, Any]:
    """A `RunCodeResponse` for one local run."""
    if run.status is RunStatus.SANDBOX_ERROR:
        return {"status": "SandboxError", "message": message or run.stderr[-500:],
                "compile_result": None, "run_result": None, "files": {}}
    ok = run.status is RunStatus.FINISHED and run.return_code == 0
    if run.status is RunStatus.OUTPUT_LIMIT:
        message = message or "output limit exceeded"
    return {"status": "Success" if ok else "Failed", "message": message, "compile_result": None,
            "run_result": {"status": _RUN_STATUS[run.status], "execution_time": run.execution_time,
                           "return_code": run.return_code, "stdout": run.stdout,
                           "stderr": run.stderr},
            "executor_pod_name": socket.gethostname(), "files": {}}


class SandboxService:
    """Request handling, separate from the aiohttp wiring so it can be called directly."""

    def __init__(self, config: SandboxServerConfig, sandbox: LocalSandbox | None = None) -> None:
        self.config = config
        self.sandbox = sandbox or LocalSandbox(config.sandbox)
        self._slots = asyncio.Semaphore(config.workers)

    async def execute(self, code: str, stdin: str | None, files: dict[str, bytes],
                      run_timeout: float | None, memory_mb: int | None) -> dict[str, Any]:
        timeout = min(run_timeout or self.config.sandbox.wall_timeout_s,
                      self.config.max_run_timeout_s)
        memory = None if not memory_mb or memory_mb < 0 else min(memory_mb,
                                                                  self.config.max_memory_mb)
        async with self._slots:
            try:
                run = await self.sandbox.run(code, stdin=stdin, files=files, timeout_s=timeout,
                                             memory_bytes=memory and memory << 20)
            except SandboxUnavailableError as e:
                return run_code_body(RunResult(RunStatus.SANDBOX_ERROR, None, "", "", 0.0), str(e))
        return run_code_body(run)

    async def run_code(self, body: dict[str, Any]) -> dict[str, Any]:
        code, language = body.get("code"), body.get("language")
        if not isinstance(code, str):
            raise _bad_request("run_code: `code` must be a string")
        if language != "python":
            raise _bad_request(f"run_code: language {language!r} unsupported; expected 'python'")
        try:
            files = {k: base64.b64decode(v, validate=True)
                     for k, v in (body.get("files") or {}).items()}
        except (ValueError, TypeError) as e:
            raise _bad_request(f"run_code: `files` must map paths to base64 strings ({e})")
        try:
            return await self.execute(code, body.get("stdin"), files, body.get("run_timeout"),
                                      body.get("memory_limit_MB"))
        except ValueError as e:  # a file path outside the working directory
            raise _bad_request(f"run_code: {e}")

    async def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        config = body.get("config") or {}
        if config.get("dataset_type") != "CommonOJDataset":
            raise _bad_request("submit: only config.dataset_type='CommonOJDataset' is supported")
        if (config.get("language") or "python") != "python":
            raise _bad_request("submit: only language 'python' is supported")
        cases = (config.get("provided_data") or {}).get("test")
        if (not isinstance(cases, list) or not isinstance(body.get("completion"), str)
                or not all(isinstance(c, dict) and isinstance(c.get("input"), dict)
                           and isinstance(c.get("output"), dict) for c in cases)):
            raise _bad_request("submit: expected `completion` and config.provided_data.test[] "
                               "of {input: {stdin}, output: {stdout}}")
        code = extract_program(body["completion"])
        tests = []
        for case in cases if code is not None else []:
            info = await self.execute(code, case["input"].get("stdin"), {},
                                      config.get("run_timeout"), None)
            run = info["run_result"]
            passed = (info["status"] == "Success"
                      and normalize_output(run["stdout"]) == normalize_output(
                          case["output"].get("stdout", "")))
            tests.append({"passed": passed, "exec_info": info, "test_info": case})
        return {"id": body.get("id"), "accepted": bool(tests) and all(t["passed"] for t in tests),
                "extracted_code": code or "", "full_code": code or "", "test_code": None,
                "tests": tests, "extracted_type": "python" if code is not None else None}


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

    async def json_body(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as e:
            raise _bad_request(f"request body is not JSON: {e}")
        if not isinstance(body, dict):
            raise _bad_request("request body must be a JSON object")
        return body

    async def run_code(request: web.Request) -> web.Response:
        return web.json_response(await service.run_code(await json_body(request)))

    async def submit(request: web.Request) -> web.Response:
        return web.json_response(await service.submit(await json_body(request)))

    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    app = web.Application(middlewares=[*middlewares, auth])
    app.add_routes([web.post("/run_code", run_code), web.post("/submit", submit),
                    web.get("/v1/ping", ping)])
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="threepo sandbox service (SandboxFusion API)")
    parser.add_argument("--host", default=SandboxServerConfig.host)
    parser.add_argument("--port", type=int, default=SandboxServerConfig.port)
    parser.add_argument("--workers", type=int, default=SandboxServerConfig.workers)
    parser.add_argument("--unconfined", action="store_true",
                        help="run WITHOUT namespace isolation (unsafe; logged loudly)")
    args = parser.parse_args(argv)
    sandbox = SandboxConfig(isolation="unconfined" if args.unconfined else "bwrap")
    config = SandboxServerConfig(host=args.host, port=args.port, workers=args.workers,
                                 auth_token=os.environ.get("THREEPO_SANDBOX_TOKEN", ""),
                                 sandbox=sandbox)
    web.run_app(make_app(config), host=config.host, port=config.port)


if __name__ == "__main__":
    main()
