"""A local sandbox for untrusted Python: the program a model wrote runs here.

Layers (operations.md §3.5), each of which a hostile program meets:
1. bubblewrap (`bwrap`) with new PID, network, IPC, UTS, mount (and cgroup) namespaces: the program
   sees only `lo`, only its own processes, read-only binds of `/usr` and the interpreter's prefix,
   a fresh `/proc`, a minimal `/dev` and its working directory. No `/etc`, no `/home`, no `/root`.
2. An unprivileged uid: as root, bwrap keeps only CAP_SETUID/SETGID/SETPCAP and `setpriv` drops
   to `SandboxConfig.uid` with every capability, the bounding set and new privileges gone. As a
   non-root caller, bwrap adds a user namespace and the program keeps the caller's (already
   unprivileged) uid.
3. rlimits set in the child before exec (CPU time, address space, processes, file size, open
   files), a wall-clock deadline that SIGKILLs the whole process group (and with it bwrap's PID
   namespace), capped stdout/stderr read incrementally, an empty environment, stdin closed.

Where bwrap is missing or refused by the platform the sandbox raises `SandboxUnavailableError`;
`isolation="unconfined"` runs with rlimits only, and only when asked for, logging loudly which
protections are missing. Install the dependency with `apt-get install -y bubblewrap`.

Not a defence against kernel exploits; for that use a gVisor pool or a remote sandbox service.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

_SANDBOX_DIR = "/sandbox"
_SIGNAL_EXIT = 128  # bwrap reports a child killed by signal s as exit code 128 + s


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation of one sandboxed run. The defaults suit short test programs."""

    wall_timeout_s: float = 10.0
    """Wall-clock deadline; past it the whole process group is SIGKILLed (status `timeout`)."""
    cpu_time_s: int = 10
    """RLIMIT_CPU in seconds (SIGXCPU at the soft limit, SIGKILL one second later)."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS: address space of each process (a memory bomb gets MemoryError)."""
    max_processes: int = 64
    """RLIMIT_NPROC: processes of the sandbox uid, which stops fork bombs. The count is per uid,
    so sandboxes running at once under one uid share it."""
    max_file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file the program may write."""
    max_open_files: int = 64
    """RLIMIT_NOFILE: open file descriptors per process."""
    max_output_bytes: int = 1 << 20
    """Cap on captured stdout and on captured stderr (each); past it the program is killed."""
    uid: int = 65534
    """Unprivileged uid (and gid) the program runs as when the sandbox is started by root."""
    isolation: str = "bwrap"
    """`bwrap` (namespaces + unprivileged uid + rlimits) or `unconfined` (rlimits only: no
    network, filesystem or PID isolation; logged as a warning on every sandbox built)."""
    python: str = field(default_factory=lambda: os.path.realpath(sys.executable))
    """Interpreter that runs the program (with `-I -S`: isolated mode, no site-packages)."""

    def __post_init__(self) -> None:
        if self.isolation not in ("bwrap", "unconfined"):
            raise ValueError(f"SandboxConfig.isolation: expected 'bwrap' or 'unconfined', "
                             f"got {self.isolation!r}")
        for name in ("wall_timeout_s", "cpu_time_s", "memory_bytes", "max_processes",
                     "max_file_bytes", "max_open_files", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name}: expected > 0, got {getattr(self, name)}")
        if self.uid <= 0:
            raise ValueError(f"SandboxConfig.uid: expected an unprivileged uid > 0, got {self.uid}")


class RunStatus(str, enum.Enum):
    FINISHED = "finished"          # exited by itself (any return code)
    TIMEOUT = "timeout"            # wall-clock deadline or CPU-time limit
    OUTPUT_LIMIT = "output_limit"  # wrote more than max_output_bytes on stdout or stderr
    SANDBOX_ERROR = "sandbox_error"  # the sandbox failed to start the program: not its fault


@dataclass(frozen=True)
class RunResult:
    status: RunStatus
    return_code: int | None
    stdout: str
    stderr: str
    execution_time: float


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this machine."""


def _interpreter_roots(python: str) -> list[str]:
    """Directories to bind read-only so the interpreter and its stdlib work inside."""
    exe = Path(python).resolve()
    prefix = exe.parent.parent  # <prefix>/bin/python3.x
    roots = ["/usr"]
    if not str(prefix).startswith("/usr/"):
        roots.append(str(prefix))
    return roots


def _bwrap_argv(cfg: SandboxConfig, workdir: str, status_fd: int) -> list[str]:
    argv = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--json-status-fd", str(status_fd)]
    for root in _interpreter_roots(cfg.python):
        argv += ["--ro-bind", root, root]
    for top in ("/lib", "/lib64", "/bin", "/lib32", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--proc", "/proc", "--dev", "/dev", "--bind", workdir, _SANDBOX_DIR,
             "--chdir", _SANDBOX_DIR, "--clearenv", "--setenv", "HOME", _SANDBOX_DIR,
             "--setenv", "TMPDIR", _SANDBOX_DIR]
    if os.geteuid() == 0:
        # Real root: no user namespace, so drop to a real unprivileged uid inside.
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
                 "setpriv", f"--reuid={cfg.uid}", f"--regid={cfg.uid}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    else:
        argv.insert(1, "--unshare-user")
    return argv + [cfg.python, "-I", "-S", "main.py"]


def _set_limits(cfg: SandboxConfig) -> None:
    """Runs in the forked child before exec; the limits pass through bwrap to the program."""
    limits = {
        resource.RLIMIT_CPU: (cfg.cpu_time_s, cfg.cpu_time_s + 1),
        resource.RLIMIT_AS: (cfg.memory_bytes, cfg.memory_bytes),
        resource.RLIMIT_NPROC: (cfg.max_processes, cfg.max_processes),
        resource.RLIMIT_FSIZE: (cfg.max_file_bytes, cfg.max_file_bytes),
        resource.RLIMIT_NOFILE: (cfg.max_open_files, cfg.max_open_files),
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)


async def _read_capped(stream: asyncio.StreamReader, cap: int, on_overflow) -> tuple[bytes, bool]:
    """Read until EOF keeping at most `cap` bytes; past the cap, call `on_overflow` (a kill)."""
    buf = bytearray()
    while chunk := await stream.read(1 << 16):
        room = cap - len(buf)
        buf += chunk[:room]
        if len(chunk) > room:
            on_overflow()
            while await stream.read(1 << 16):  # discard until the killed group closes the pipe
                pass
            return bytes(buf), True
    return bytes(buf), False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone: nothing left to kill
        pass


def _safe_relpath(path: str) -> PurePosixPath:
    rel = PurePosixPath(path)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ValueError(f"files: expected a relative path inside the working directory, got {path!r}")
    return rel


class LocalSandbox:
    """Runs Python programs under `SandboxConfig`; `await run(code)` returns a `RunResult`."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._checked = False
        if self.config.isolation == "unconfined":
            log.warning("LocalSandbox running UNCONFINED (isolation='unconfined'): rlimits only; "
                        "NO network isolation, NO filesystem isolation, NO PID isolation, runs as "
                        "uid %d. Use only for trusted code.", os.geteuid())

    def _check_isolation(self) -> None:
        if self._checked or self.config.isolation == "unconfined":
            return
        if shutil.which("bwrap") is None:
            raise SandboxUnavailableError(
                "bubblewrap (bwrap) is not installed: run `apt-get install -y bubblewrap`, or set "
                "SandboxConfig.isolation='unconfined' to run WITHOUT isolation (unsafe)")
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            raise SandboxUnavailableError("running as root needs util-linux `setpriv` to drop "
                                          "privileges inside the sandbox; it is not on PATH")
        self._checked = True

    async def run(self, code: str, stdin: str | None = None, files: dict[str, bytes] | None = None,
                  timeout_s: float | None = None, memory_bytes: int | None = None) -> RunResult:
        """Run `code` as `main.py` in a fresh working directory (with `files` written beside it)."""
        self._check_isolation()
        cfg = self.config
        if timeout_s is not None or memory_bytes is not None:
            cfg = replace(cfg, wall_timeout_s=timeout_s or cfg.wall_timeout_s,
                          memory_bytes=memory_bytes or cfg.memory_bytes)
        workdir = tempfile.mkdtemp(prefix="threepo-sandbox-")
        try:
            self._populate(workdir, code, stdin, files or {}, cfg)
            return await self._execute(cfg, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _populate(self, workdir: str, code: str, stdin: str | None, files: dict[str, bytes],
                  cfg: SandboxConfig) -> None:
        Path(workdir, "main.py").write_text(code)
        if stdin is not None:
            Path(workdir, ".stdin").write_text(stdin)
        for name, content in files.items():
            target = Path(workdir, _safe_relpath(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        os.chmod(workdir, 0o700)
        if os.geteuid() == 0 and cfg.isolation == "bwrap":
            for path in [workdir, *(str(p) for p in Path(workdir).rglob("*"))]:
                os.chown(path, cfg.uid, cfg.uid)

    async def _execute(self, cfg: SandboxConfig, workdir: str) -> RunResult:
        status_r, status_w = os.pipe()
        stdin_path = Path(workdir, ".stdin")
        stdin = open(stdin_path, "rb") if stdin_path.exists() else None
        if cfg.isolation == "bwrap":
            argv, cwd, pass_fds = _bwrap_argv(cfg, workdir, status_w), None, (status_w,)
        else:
            argv, cwd, pass_fds = [cfg.python, "-I", "-S", "main.py"], workdir, ()
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env={}, stdin=stdin or asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, pass_fds=pass_fds, preexec_fn=lambda: _set_limits(cfg))
        finally:
            os.close(status_w)
            if stdin is not None:
                stdin.close()
        try:
            return await _supervise(proc, cfg, start, status_r)
        finally:
            os.close(status_r)


async def _supervise(proc: asyncio.subprocess.Process, cfg: SandboxConfig, start: float,
                     status_r: int) -> RunResult:
    """Wait for `proc` under the deadline and the output caps, then classify the outcome."""
    kill = lambda: _kill_group(proc.pid)  # noqa: E731
    out = asyncio.ensure_future(_read_capped(proc.stdout, cfg.max_output_bytes, kill))
    err = asyncio.ensure_future(_read_capped(proc.stderr, cfg.max_output_bytes, kill))
    waiter = asyncio.ensure_future(proc.wait())
    _, pending = await asyncio.wait([out, err, waiter], timeout=cfg.wall_timeout_s)
    timed_out = bool(pending)
    if timed_out:
        kill()
        # The PID namespace dies with bwrap, which closes the pipes; bound the wait anyway
        # (unconfined, an escaped grandchild could hold them open).
        _, still = await asyncio.wait([out, err, waiter], timeout=5.0)
        for task in still:
            task.cancel()
    elapsed = time.monotonic() - start
    stdout, out_over = out.result() if out.done() and not out.cancelled() else (b"", False)
    stderr, err_over = err.result() if err.done() and not err.cancelled() else (b"", False)
    if proc.returncode is None:
        await proc.wait()
    started = cfg.isolation == "unconfined" or b"child-pid" in _read_all(status_r)
    status = _classify(started, timed_out, out_over or err_over, proc.returncode)
    return RunResult(status, proc.returncode, stdout.decode(errors="replace"),
                     stderr.decode(errors="replace"), elapsed)


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except BlockingIOError:  # writer still open somewhere: take what is there
        pass
    return b"".join(chunks)


def _classify(started: bool, timed_out: bool, over: bool, code: int) -> RunStatus:
    if timed_out:
        return RunStatus.TIMEOUT
    if over:
        return RunStatus.OUTPUT_LIMIT
    if not started:
        return RunStatus.SANDBOX_ERROR
    cpu_signals = {signal.SIGXCPU, signal.SIGKILL}
    if code in {-s for s in cpu_signals} | {_SIGNAL_EXIT + s for s in cpu_signals}:
        return RunStatus.TIMEOUT
    return RunStatus.FINISHED
