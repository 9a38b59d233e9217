"""A local sandbox for untrusted Python: the program a model wrote runs here.

Layers (operations.md §3.5), each of which a hostile program meets:
1. bubblewrap (`bwrap`) with new PID, network, IPC, UTS, mount (and cgroup) namespaces: the program
   sees only `lo` and its own processes. Its filesystem is exactly: `/usr` and the host's `/bin`,
   `/lib*` (read-only), the interpreter's prefix at `/opt/python` (read-only; only for one installed
   outside `/usr`, e.g. pyenv or conda), a fresh `/proc`, a minimal `/dev` and its working directory
   `/sandbox` (HOME and TMPDIR). No `/etc`, `/home`, `/root`, `/tmp`, `/var` or host paths.
   The program runs on `SandboxConfig.python` (default: the interpreter running threepo, so
   programs meet the Python version the verifier expects); `LocalSandbox.interpreter()` says
   which, as seen from inside.
2. An unprivileged uid: as root, bwrap keeps only CAP_SETUID/SETGID/SETPCAP and `setpriv` drops
   to a uid of its own with every capability, the bounding set and new privileges gone. Each run
   holds one uid of the pool `SandboxConfig.uid ...` (claimed with a lock file, so across
   processes on the host too): per-uid limits such as RLIMIT_NPROC are then per run, and a fork
   bomb cannot starve a neighbour. As a non-root caller, bwrap adds a user namespace and the
   program keeps the caller's (already unprivileged) uid.
3. rlimits set in the child before exec (CPU time, address space, processes, file size, open
   files), a wall-clock deadline that SIGKILLs the whole process group (and with it bwrap's PID
   namespace), capped stdout/stderr read incrementally, an empty environment, and on stdin only
   what the caller gives (from a file with no name; empty otherwise).

Where bwrap is missing or refused by the platform the sandbox raises `SandboxUnavailableError`;
`isolation="unconfined"` runs with rlimits only, and only when asked for, logging loudly which
protections are missing. Install the dependency with `apt-get install -y bubblewrap`.

Not a defence against kernel exploits; for that use a gVisor pool or a remote sandbox service.
"""

from __future__ import annotations

import asyncio
import enum
import fcntl
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from threepo.services.verifiers.pipes import exited, pipe_reader, read_all, read_capped

log = logging.getLogger(__name__)

_SANDBOX_DIR = "/sandbox"
_SIGNAL_EXIT = 128  # bwrap reports a child killed by signal s as exit code 128 + s
_TIMEOUT_EXIT = 124  # coreutils `timeout` when its deadline (the in-sandbox backstop) fired
_BACKSTOP_S = 2.0
_CPU_LIMIT_SHARE = 0.9  # of cpu_time_s: a signal death after that much wall time is the CPU-time limit
_PYTHON_MOUNT = "/opt/python"
OUTPUT_LIMIT_MESSAGE = "output limit exceeded"  # RunStatus.OUTPUT_LIMIT in words, locally and over HTTP


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
    """RLIMIT_NPROC: processes of the run's uid, which stops fork bombs."""
    max_file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file the program may write."""
    max_open_files: int = 64
    """RLIMIT_NOFILE: open file descriptors per process."""
    max_output_bytes: int = 1 << 20
    """Cap on captured stdout and on captured stderr (each); past it the program is killed."""
    uid: int = 200000
    """First uid (and gid) of the pool runs use when started by root. Uids without a passwd
    entry, owning no file on the host, suit best; 65534 (nobody) works with a pool of 1."""
    uid_pool_size: int = 256
    """How many uids the pool holds: the most runs at once on one host."""
    max_parallel: int = 8
    """Runs at once through one LocalSandbox; further runs wait."""
    isolation: str = "bwrap"
    """`bwrap` (namespaces + unprivileged uid + rlimits) or `unconfined` (rlimits only: no
    network, filesystem or PID isolation; logged as a warning on every sandbox built)."""
    python: str = field(default_factory=lambda: os.path.realpath(sys.executable))
    """Interpreter that runs the program (with `-I -S`: isolated mode, no site-packages); default:
    the one running threepo. Outside /usr it is seen inside at /opt/python."""

    def __post_init__(self) -> None:
        if self.isolation not in ("bwrap", "unconfined"):
            raise ValueError(f"SandboxConfig.isolation: expected 'bwrap' or 'unconfined', "
                             f"got {self.isolation!r}")
        for name in ("wall_timeout_s", "cpu_time_s", "uid_pool_size", "max_parallel", "memory_bytes", "max_processes",
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


def interpreter_paths(python: str) -> tuple[str, str]:
    """(host prefix to bind at /opt/python, "" for one under /usr; the interpreter's path inside)."""
    exe = Path(python).resolve()
    prefix = exe.parent.parent  # <prefix>/bin/python3.x
    if prefix == Path("/usr") or prefix.is_relative_to("/usr"):
        return "", str(exe)
    return str(prefix), f"{_PYTHON_MOUNT}/{exe.relative_to(prefix)}"


def _bwrap_argv(cfg: SandboxConfig, workdir: str, started_fd: int, backstop: bool = True) -> list[str]:
    root = os.geteuid() == 0
    argv = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if not root:
        argv.append("--unshare-user")
    prefix, exe = interpreter_paths(cfg.python)
    argv += ["--ro-bind", "/usr", "/usr"]
    if prefix:  # bwrap makes missing parents 0700, which the program's uid could not search
        argv += ["--perms", "0755", "--dir", os.path.dirname(_PYTHON_MOUNT), "--ro-bind", prefix, _PYTHON_MOUNT]
    for top in ("/lib", "/lib64", "/bin", "/lib32", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--proc", "/proc", "--dev", "/dev", "--bind", workdir, _SANDBOX_DIR,
             "--chdir", _SANDBOX_DIR, "--clearenv", "--setenv", "HOME", _SANDBOX_DIR,
             "--setenv", "TMPDIR", _SANDBOX_DIR]
    if prefix:  # a shared libpython's RUNPATH names the host prefix, which is not there
        argv += ["--setenv", "LD_LIBRARY_PATH", f"{_PYTHON_MOUNT}/lib"]
    if root:  # no user namespace, so setpriv drops to a real unprivileged uid inside
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    # Backstop deadline inside: when the main child dies, bwrap's PID 1 exits and the kernel
    # kills the whole namespace, even if this process is gone and cannot kill the group.
    # (`backstop=False`: a long-lived sandbox, the code_tests harness's trusted runner, which keeps its own)
    argv += ["--"] + (["timeout", "--signal=KILL", f"{cfg.wall_timeout_s + _BACKSTOP_S:g}"] if backstop else [])
    if root:
        argv += ["setpriv", f"--reuid={cfg.uid}", f"--regid={cfg.uid}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return argv + _python_argv(exe, started_fd)


def launch_argv(cfg: SandboxConfig, workdir: str, started_fd: int, backstop: bool = True) -> tuple[list[str], str | None]:
    """(argv, cwd) that runs `workdir`/main.py under `cfg`'s isolation (`backstop`: see `_bwrap_argv`)."""
    if cfg.isolation == "bwrap":
        return _bwrap_argv(cfg, workdir, started_fd, backstop), None
    return _python_argv(cfg.python, started_fd), workdir


def _python_argv(python: str, started_fd: int) -> list[str]:
    """The interpreter running main.py, after writing one byte to `started_fd` and closing it.

    That byte is how the parent tells "the sandbox failed to start" (infra_error) from "the
    program failed": it is written before the program runs, so a program cannot take it back
    and pass its own failure off as an infrastructure failure (a NaN reward, out of the batch).
    """
    launcher = (f"import os, sys; os.write({started_fd}, b'1'); os.close({started_fd}); "
                "sys.argv[:] = ['main.py']; exec(compile(open('main.py').read(), 'main.py', "
                "'exec'), {'__name__': '__main__', '__file__': 'main.py', "
                "'__builtins__': __builtins__})")
    return [python, "-I", "-S", "-c", launcher]


def _set_limits(cfg: SandboxConfig, cpu: bool = True) -> None:
    """Runs in the forked child before exec; the limits pass through bwrap to the program (`cpu=False`:
    no CPU-time limit, for a long-lived sandbox whose children set their own)."""
    limits = {
        resource.RLIMIT_CPU: (cfg.cpu_time_s, cfg.cpu_time_s + 1) if cpu else (resource.RLIM_INFINITY,) * 2,
        resource.RLIMIT_AS: (cfg.memory_bytes, cfg.memory_bytes),
        resource.RLIMIT_NPROC: (cfg.max_processes, cfg.max_processes),
        resource.RLIMIT_FSIZE: (cfg.max_file_bytes, cfg.max_file_bytes),
        resource.RLIMIT_NOFILE: (cfg.max_open_files, cfg.max_open_files),
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)



def _claim_uid(base: int, size: int) -> tuple[int, int]:
    """Lock one free uid of [base, base + size) for this run; returns (uid, lock fd)."""
    lock_dir = Path(tempfile.gettempdir(), "threepo-sandbox-uids")
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    start = os.getpid() % size  # processes start at different places to contend less
    for k in range(size):
        uid = base + (start + k) % size
        fd = os.open(lock_dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:  # held by a run in progress: try the next uid
            os.close(fd)
    raise SandboxUnavailableError(f"all {size} sandbox uids from {base} are busy; raise "
                                  "SandboxConfig.uid_pool_size or lower max_parallel")


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
        self._interpreter: str | None = None
        self._parallel = asyncio.Semaphore(self.config.max_parallel)
        if self.config.isolation == "unconfined":
            log.warning("LocalSandbox running UNCONFINED (isolation='unconfined'): rlimits only; "
                        "NO network isolation, NO filesystem isolation, NO PID isolation, runs as "
                        "uid %d. Use only for trusted code.", os.geteuid())

    async def _check_isolation(self) -> None:
        """Once: bwrap is there and can build a sandbox here (namespaces may be forbidden)."""
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
        probe = await self.run("print('ok')")
        if probe.status is not RunStatus.FINISHED or probe.stdout != "ok\n":
            self._checked = False
            raise SandboxUnavailableError(
                f"bubblewrap cannot build a sandbox on this machine ({probe.status.value}): "
                f"{probe.stderr.strip()[-500:]}; user or network namespaces may be forbidden "
                "(container seccomp/AppArmor profile); use a remote sandbox instead")

    async def interpreter(self) -> str:
        """Which Python runs the programs, as a program sees it: e.g. 'CPython 3.11.7 /opt/python/bin/python3.11'."""
        if self._interpreter is None:
            run = await self.run("import platform, sys; print(platform.python_implementation(), "
                                 "platform.python_version(), sys.executable)")
            if run.status is not RunStatus.FINISHED or run.return_code != 0:
                raise SandboxUnavailableError(f"the sandbox's interpreter does not start: {run.stderr[-300:]}")
            self._interpreter = run.stdout.strip()
        return self._interpreter

    async def run(self, code: str, stdin: str | None = None, files: dict[str, bytes] | None = None,
                  timeout_s: float | None = None, memory_bytes: int | None = None) -> RunResult:
        """Run `code` as `main.py` in a fresh working directory (with `files` written beside it)."""
        await self._check_isolation()
        cfg = replace(self.config, wall_timeout_s=timeout_s or self.config.wall_timeout_s,
                      memory_bytes=memory_bytes or self.config.memory_bytes)
        async with self._parallel:
            lease = None
            if os.geteuid() == 0 and cfg.isolation == "bwrap":
                uid, lease = _claim_uid(cfg.uid, cfg.uid_pool_size)
                cfg = replace(cfg, uid=uid)
            workdir = tempfile.mkdtemp(prefix="threepo-sandbox-")
            try:
                self._populate(workdir, code, files or {}, cfg)
                return await self._execute(cfg, workdir, stdin)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
                if lease is not None:
                    os.close(lease)  # releases the flock

    def _populate(self, workdir: str, code: str, files: dict[str, bytes], cfg: SandboxConfig) -> None:
        Path(workdir, "main.py").write_text(code)
        for name, content in files.items():
            target = Path(workdir, _safe_relpath(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        os.chmod(workdir, 0o700)
        if os.geteuid() == 0 and cfg.isolation == "bwrap":
            for path in [workdir, *(str(p) for p in Path(workdir).rglob("*"))]:
                os.chown(path, cfg.uid, cfg.uid)

    async def _execute(self, cfg: SandboxConfig, workdir: str, stdin_text: str | None) -> RunResult:
        started_r, started_w = os.pipe()
        argv, cwd = launch_argv(cfg, workdir, started_w)
        start = time.monotonic()
        # A plain Popen, not asyncio's: its cancellation path kills bwrap alone, which can strand
        # a half-built sandbox PID 1 holding our pipes. Here every exit path kills the group.
        try:
            # stdin from a file without a name: the program reads it on fd 0 only, nowhere in its directory
            with tempfile.TemporaryFile() as stdin:
                stdin.write((stdin_text or "").encode())
                stdin.seek(0)
                proc = subprocess.Popen(argv, cwd=cwd, env={}, stdin=stdin, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True,
                                        pass_fds=(started_w,), preexec_fn=lambda: _set_limits(cfg))
        finally:
            os.close(started_w)
        try:
            return await _supervise(proc, cfg, start, started_r)
        finally:
            if proc.returncode is None:  # cancelled or failed: the program must not outlive us
                _kill_group(proc.pid)
                proc.wait()
            # proc.stdout and stderr are their transports' to close: closed here first, their fds could
            # be reused before uvloop's own close of them (a double close of someone else's fd)
            os.close(started_r)




async def _supervise(proc: subprocess.Popen, cfg: SandboxConfig, start: float,
                     started_r: int) -> RunResult:
    """Wait for `proc` under the deadline and the output caps, then classify the outcome."""
    kill = lambda: _kill_group(proc.pid)  # noqa: E731
    (out_r, out_t), (err_r, err_t) = await pipe_reader(proc.stdout), await pipe_reader(proc.stderr)
    out = asyncio.ensure_future(read_capped(out_r, cfg.max_output_bytes, kill))
    err = asyncio.ensure_future(read_capped(err_r, cfg.max_output_bytes, kill))
    waiter = asyncio.ensure_future(exited(proc.pid))
    tasks = [out, err, waiter]
    try:
        _, pending = await asyncio.wait(tasks, timeout=cfg.wall_timeout_s)
        timed_out = bool(pending)
        if timed_out:
            kill()
            # The PID namespace dies with bwrap, which closes the pipes; bound the wait anyway
            # (unconfined, an escaped grandchild could hold them open).
            await asyncio.wait(tasks, timeout=5.0)
    finally:
        if not waiter.done():
            kill()  # cancelled, or the pipes outlived the kill
        for task in tasks:
            task.cancel()
        out_t.close()
        err_t.close()
    proc.wait()  # the group is dead or dying: reaps at once
    elapsed = time.monotonic() - start
    stdout, out_over = out.result() if out.done() and not out.cancelled() else (b"", False)
    stderr, err_over = err.result() if err.done() and not err.cancelled() else (b"", False)
    started = read_all(started_r).startswith(b"1")
    # RLIMIT_CPU is per process: a process it killed ran at least cpu_time_s, so not before that much wall time
    status = _classify(started, timed_out, out_over or err_over, proc.returncode,
                       elapsed >= cfg.cpu_time_s * _CPU_LIMIT_SHARE)
    return RunResult(status, proc.returncode, stdout.decode(errors="replace"),
                     stderr.decode(errors="replace"), elapsed)



def _classify(started: bool, timed_out: bool, over: bool, code: int, cpu_spent: bool) -> RunStatus:
    """The outcome of a run. A SIGXCPU or SIGKILL death is the CPU-time limit only when the run lasted
    (nearly) its CPU time (`cpu_spent`); sooner, the program killed itself: FINISHED, its code kept."""
    if timed_out:
        return RunStatus.TIMEOUT
    if over:
        return RunStatus.OUTPUT_LIMIT
    if not started:
        return RunStatus.SANDBOX_ERROR
    cpu_signals = {signal.SIGXCPU, signal.SIGKILL}
    if code == _TIMEOUT_EXIT or (cpu_spent and code in {-s for s in cpu_signals} | {_SIGNAL_EXIT + s for s in cpu_signals}):
        return RunStatus.TIMEOUT
    return RunStatus.FINISHED
