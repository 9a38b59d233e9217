"""The run's `[sandbox]` section: where the remote sandbox service is and how the `remote_sandbox`
verifier calls it (services/verifiers/remote.py spells out the deadline, retry, breaker and outage
rules these settings feed), and the one place its token is read.

A row reaches the remote sandbox by naming `remote_sandbox` or by `verifier.route`, e.g.
`verifier.route=[["code_output", "remote_sandbox"]]` for the code task. No setting holds a secret:
the token is read from the environment variable `auth_env` names, in the driver, which hands it to
the verifier actors it starts; it never enters a config file or a run directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from threepo.services.errors import UserInputError
from threepo.services.verifiers.base import BACKOFF_BASE_S, BACKOFF_MAX_S, JITTER


@dataclass(frozen=True)
class RemoteSandboxConfig:
    """The remote sandbox service (`[sandbox]`): where it is and how the client calls it.

    Endpoints, the token's variable, limits sent with each run, deadlines, the client's retries,
    circuit breaker and outage bound."""

    endpoints: tuple[str, ...] = ("http://127.0.0.1:8080",)
    """Base URLs of the service (SandboxFusion API), used round-robin, e.g.
    `http://sandbox.verifier.svc:8080`."""
    auth_env: str = ""
    """Name of the environment variable (in the driver's environment) holding the service's bearer
    token ('' = no token); the token itself is never part of a config file."""
    auth_header: str = "Authorization"
    """Header that carries the token (`<auth_header>: Bearer <token>`)."""
    compile_timeout_s: float = 10.0
    """Compile limit sent with each run (`compile_timeout`)."""
    run_timeout_s: float = 10.0
    """Run limit sent with each run (`run_timeout`)."""
    memory_limit_mb: int = -1
    """Memory limit sent with each run as `memory_limit_MB` (-1: the service's own default)."""
    queue_timeout_s: float = 30.0
    """How long a request may wait at the service for a free worker; past it the service answers 504
    without running it (retried). A run's own timeout starts when it does."""
    request_margin_s: float = 10.0
    """Each HTTP request's deadline is queue_timeout_s + compile_timeout_s + run_timeout_s + this;
    past it the request is retried on the next endpoint."""
    max_attempts: int = 8
    """Failed attempts of one call, counted only while other requests get answers, before it ends as
    infra_error (a request no endpoint can serve)."""
    backoff_base_s: float = BACKOFF_BASE_S
    """The client's delay before retry k (k = 0, 1, ...): min(backoff_max_s, base · 2^k) · U(1 − jitter, 1)."""
    backoff_max_s: float = BACKOFF_MAX_S
    """Cap on one of the client's retry delays."""
    jitter: float = JITTER
    """Fraction of each of the client's retry delays drawn at random, in [0, 1]."""
    unhealthy_after: int = 5
    """Consecutive failures that open an endpoint's circuit breaker."""
    cooldown_s: float = 5.0
    """How long an open breaker waits before one probe request may try the endpoint again."""
    outage_s: float = 180.0
    """When no endpoint has answered any request for this long, a waiting call raises VerifierOutage:
    the driver stops the run cleanly (resume it once the service is back)."""
    process_concurrency: int = 64
    """HTTP requests in flight from one process when no limiter is given (a run gives the cluster-wide
    one of `verifier.cluster_concurrency`, deploy/limiter.py)."""
    seed: int = 0
    """Seed of the client's retry jitter; in a run, the run's `seed` unless set."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", tuple(self.endpoints))
        if not self.endpoints or not all(isinstance(e, str) and e.startswith(("http://", "https://"))
                                         for e in self.endpoints):
            raise ValueError(f"sandbox.endpoints: expected http(s) URLs, got {self.endpoints!r}")
        if self.auth_env and not self.auth_env.replace("_", "").isalnum():
            raise ValueError(f"sandbox.auth_env: expected the NAME of an environment variable, got "
                             f"{self.auth_env!r} (never put the token itself in the config)")
        if self.memory_limit_mb != -1 and self.memory_limit_mb < 1:
            raise ValueError(f"sandbox.memory_limit_mb: expected -1 (the service's default) or >= 1, "
                             f"got {self.memory_limit_mb}")
        for name in ("max_attempts", "unhealthy_after", "process_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"sandbox.{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("compile_timeout_s", "run_timeout_s", "request_margin_s", "queue_timeout_s", "cooldown_s",
                     "outage_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name}: expected > 0, got {getattr(self, name)}")
        if not 0 <= self.backoff_base_s <= self.backoff_max_s or not 0 <= self.jitter <= 1:
            raise ValueError("sandbox.backoff_base_s/backoff_max_s/jitter: expected 0 <= base <= max and "
                             f"jitter in [0, 1], got {self.backoff_base_s}, {self.backoff_max_s}, {self.jitter}")

    def token(self) -> str:
        """The token in the environment variable `auth_env` names ('' when it names none); a name
        that is not set is an error naming `sandbox.auth_env`."""
        if not self.auth_env:
            return ""
        if self.auth_env not in os.environ:
            raise UserInputError(f"sandbox.auth_env={self.auth_env!r}: the environment variable is not set; "
                                 "expected it to hold the sandbox's token")
        return os.environ[self.auth_env]
