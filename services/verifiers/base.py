"""The verifier plug-in protocol and how verifiers are found by name.

A verifier is any object with a `name` and an `async verify(request) -> VerifyResult`. Built-in
verifiers are listed in `BUILTIN`; third-party ones register a factory under the Python entry-point
group `threepo.verifiers` (in their own pyproject: `[project.entry-points."threepo.verifiers"]
myname = "mypkg.module:make_verifier"`). A factory takes keyword options from the config and
returns a verifier.

Contract every verifier keeps:
- `verify` never raises for a bad completion: it returns a status. It raises only for a bug.
- An infrastructure failure (sandbox down, timeout of the checker itself rather than of the
  program) returns `infra_error` with a NaN reward, never `wrong` with 0.
- A verifier whose service has been down longer than its configured bound raises `VerifierOutage`
  instead: the verifier pool and the Ray actor let it through, so the caller (the driver) can stop
  the run cleanly and resume it once the service is back.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from threepo.services.wire.messages import VerifyRequest, VerifyResult

# Retry and concurrency defaults, written once: the pool's (`[verifier]`, pool.VerifierConfig) and the
# remote sandbox client's (`[sandbox]`, sandbox_config.RemoteSandboxConfig) start from these values.
MAX_CONCURRENCY, INFRA_RETRIES, BACKOFF_BASE_S, BACKOFF_MAX_S, JITTER = 8, 3, 0.5, 10.0, 0.5

ENTRY_POINT_GROUP = "threepo.verifiers"

# name -> "module:factory"; imported only when asked for, so importing this module stays free.
BUILTIN: dict[str, str] = {
    "math": "threepo.services.verifiers.math_verifier:MathVerifier",
    "countdown": "threepo.services.verifiers.math_verifier:CountdownVerifier",
    "code_output": "threepo.services.verifiers.code_verifiers:code_output",
    "code_tests": "threepo.services.verifiers.code_verifiers:code_tests",
    "remote_sandbox": "threepo.services.verifiers.remote:RemoteSandboxVerifier",
}


class VerifierOutage(RuntimeError):
    """Every endpoint of a verifier service has been down longer than its bound (`outage_s`): no
    verification can be done now, so the run should stop (and resume later) rather than fail rows.
    Raised by `verify`, passed on by `VerifierPool.verify_batch` and so by the verifier actor's Ray
    call (`ray.get` raises an exception that is an instance of this class)."""


@runtime_checkable
class Verifier(Protocol):
    name: str

    async def verify(self, request: VerifyRequest) -> VerifyResult: ...

    def close(self) -> None: ...


def available_verifiers() -> list[str]:
    """Names of built-in and installed plug-in verifiers."""
    return sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_verifier(name: str, **options: Any) -> Verifier:
    """Build the verifier called `name` with `options`; unknown names fail with the known ones."""
    if name in BUILTIN:
        module, _, attr = BUILTIN[name].partition(":")
        factory = getattr(importlib.import_module(module), attr)
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise KeyError(
                f"unknown verifier {name!r}: expected one of {available_verifiers()} "
                f"(plug-ins register under the entry-point group {ENTRY_POINT_GROUP!r})"
            )
        factory = found[0].load()
    verifier = factory(**options)
    if not isinstance(verifier, Verifier):
        raise TypeError(f"verifier {name!r}: factory returned {type(verifier).__name__}, "
                        "which lacks `name`, `async verify(request)` or `close()`")
    return verifier
