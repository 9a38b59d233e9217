"""The SandboxFusion-style wire format shared by the client (services/verifiers/remote.py) and the
service (services/verifiers/sandbox_server.py): a response's typed view, how it maps onto the local
sandbox's `RunResult`, and the start-by header. services/verifiers/remote.py's docstring gives the
fields of each endpoint."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from threepo.services.verifiers.sandbox import OUTPUT_LIMIT_MESSAGE, RunResult, RunStatus

START_BY_HEADER = "X-Threepo-Start-By-S"  # seconds within which the service must start the program, else 504 unrun


class SandboxInfraError(RuntimeError):
    """The remote sandbox could not give an answer about the program."""


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
    if run.status == "Error" and OUTPUT_LIMIT_MESSAGE in response.message:  # the server's word for the cap
        status = RunStatus.OUTPUT_LIMIT
    code = run.return_code if run.status == "Finished" else (run.return_code or -1)
    return RunResult(status, code, run.stdout, run.stderr, run.execution_time or 0.0)
