"""The code_tests harness's two processes (`run_tests`; services/verifiers/harness.py says what each
side does, services/verifiers/sandbox.py what the sandbox is).

The program's side runs in the sandbox exactly as `LocalSandbox.run` runs a program (bwrap, its own
PID namespace, an unprivileged uid, rlimits, a deadline, capped output). The trusted sides run in a
sandbox of their own, built the same way (own PID, network and mount namespaces, and as root a uid of
its own: the program's process cannot see them, signal them or read their memory): one long-lived
trusted runner per `LocalSandbox`, started at its first run, forks a child per run (a run then costs
one sandbox, not two). The child takes the tests from a file in the runner's private directory (which
the program's sandbox does not mount) and its three pipe ends over a socket; it starts before the
program does, so a program cannot keep it from starting. Two pipes join the sides — requests from the
trusted side, replies from the program's — and a third carries the trusted side's start byte and
report. The run ends when the report pipe closes (the trusted side has reported), or at the deadline;
the program's process group is killed either way, and a trusted child still running at the deadline
ends by its own alarm. A runner that died (e.g. with the thread that started it) is started again.

The `RunResult`: the trusted side's output (the report; its verdict is what scores), return code 0
when that side ended in time (None otherwise), the program's stderr; status `sandbox_error` when either side did not
start, `timeout` past the deadline or when the program's process died of its CPU-time limit,
`output_limit` when either side wrote too much.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from dataclasses import replace
from pathlib import Path

from threepo.services.verifiers import sandbox as sb
from threepo.services.verifiers.harness import program_files, run_message, runner_source
from threepo.services.verifiers.pipes import exited, read_all

_TRUSTED_MARGIN_S = 0.5  # the trusted side's own deadline comes this much before the run's
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LocalSandbox -> its TrustedRunner


class TrustedRunner:
    """The long-lived sandbox whose children run the trusted sides (see the module docstring)."""

    def __init__(self, box: sb.LocalSandbox) -> None:
        self.box, self.cfg = weakref.proxy(box), box.config
        self.proc = self.sock = self.lease = self.directory = None
        self._names = itertools.count()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start (again) the runner's sandbox and wait for it to run."""
        self.close()
        cfg = self.cfg
        if os.geteuid() == 0 and cfg.isolation == "bwrap":
            uid, self.lease = sb._claim_uid(cfg.uid, cfg.uid_pool_size)
            cfg = replace(cfg, uid=uid)
        self.directory = tempfile.mkdtemp(prefix="threepo-tests-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started_r, started_w = os.pipe()
        try:
            self.box._populate(self.directory, runner_source(theirs.fileno()), {}, cfg)
            argv, cwd = sb.launch_argv(cfg, self.directory, started_w, backstop=False)
            self.proc = subprocess.Popen(argv, cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, start_new_session=True,
                                         pass_fds=(started_w, theirs.fileno()),
                                         preexec_fn=lambda: sb._set_limits(cfg, cpu=False))
            os.close(started_w)
            started_w = -1
            if os.read(started_r, 1) != b"1":
                why = self.proc.stderr.read().decode(errors="replace")[-500:]
                raise sb.SandboxUnavailableError(f"the code_tests harness's trusted runner did not start: {why}")
        finally:
            theirs.close()
            os.close(started_r)
            if started_w >= 0:
                os.close(started_w)
        self.sock, self.uid = ours, cfg.uid

    def submit(self, message: bytes, fds: list[int]) -> None:
        """Hand one run to the runner: `message` (harness.run_message) and (requests out, replies in,
        report out); starts the runner first when it is not running."""
        for attempt in range(2):
            if not self.alive():
                self.start()
            path = Path(self.directory, f"run-{next(self._names)}")
            path.write_bytes(message)
            if os.geteuid() == 0 and self.cfg.isolation == "bwrap":
                os.chown(path, self.uid, self.uid)
            inside = f"{sb._SANDBOX_DIR}/{path.name}" if self.cfg.isolation == "bwrap" else str(path)
            try:
                socket.send_fds(self.sock, [inside.encode()], fds)
                return
            except OSError:  # it died since: once more on a fresh one
                path.unlink(missing_ok=True)
                if attempt:
                    raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None and self.proc.poll() is None:
            sb._kill_group(self.proc.pid)
            self.proc.wait()
        if self.proc is not None:
            self.proc.stderr.close()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self.lease is not None:
            os.close(self.lease)
        self.proc = self.sock = self.lease = self.directory = None

    def __del__(self) -> None:
        self.close()


async def run_tests(box: sb.LocalSandbox, program: str, tests: tuple[str, ...] | list[str], token: str,
                    timeout_s: float | None = None, memory_bytes: int | None = None) -> sb.RunResult:
    """Run `program` in `box`'s sandbox and `tests` against it in a trusted process; see the module
    docstring."""
    await box._check_isolation()
    cfg = replace(box.config, wall_timeout_s=timeout_s or box.config.wall_timeout_s,
                  memory_bytes=memory_bytes or box.config.memory_bytes)
    runner = _RUNNERS.get(box)
    if runner is None:
        runner = _RUNNERS[box] = TrustedRunner(box)
    async with box._parallel:
        lease = None
        if os.geteuid() == 0 and cfg.isolation == "bwrap":
            uid, lease = sb._claim_uid(cfg.uid, cfg.uid_pool_size)
            cfg = replace(cfg, uid=uid)
        workdir = tempfile.mkdtemp(prefix="threepo-sandbox-")
        try:
            return await _execute(box, runner, cfg, workdir, program, tests, token)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if lease is not None:
                os.close(lease)


class _Drain:
    """Reads a pipe to EOF from the event loop (`add_reader`, no transport: the fd stays this object's
    to close, after its reader is removed), keeping at most `cap` bytes; past the cap `on_overflow`."""

    def __init__(self, fd: int, cap: int, on_overflow=lambda: None) -> None:
        self.fd, self.cap, self.on_overflow, self.data, self.over = fd, cap, on_overflow, bytearray(), False
        self.loop = asyncio.get_running_loop()
        self.done, self.grew = self.loop.create_future(), None
        os.set_blocking(fd, False)
        self.loop.add_reader(fd, self._ready)

    def _ready(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not self.over:
            self.data += chunk[:self.cap - len(self.data)]
            if len(self.data) >= self.cap and chunk:
                self.over = True
                self.on_overflow()
        if self.grew is not None and not self.grew.done():
            self.grew.set_result(None)
        if not chunk:
            self.stop()
            if not self.done.done():
                self.done.set_result(None)

    async def first_byte(self, timeout_s: float) -> bytes:
        """The first byte read (b"" at EOF or past `timeout_s`)."""
        while not self.data and not self.done.done():
            self.grew = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self.grew), timeout_s)
            except asyncio.TimeoutError:
                break
        return bytes(self.data[:1])

    def stop(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)

    def close(self) -> None:
        self.stop()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


async def _execute(box: sb.LocalSandbox, runner: TrustedRunner, cfg: sb.SandboxConfig, workdir: str, program: str,
                   tests, token: str) -> sb.RunResult:
    """Hand the trusted side to the runner, then (once its child runs) start the program's; supervise."""
    start = time.monotonic()
    (requests_r, requests_w), (replies_r, replies_w), (report_r, report_w) = os.pipe(), os.pipe(), os.pipe()
    started_r, started_w = os.pipe()
    child_fds = [requests_w, replies_r, report_w, requests_r, replies_w, started_w]
    drains, proc = [_Drain(report_r, cfg.max_output_bytes + 1)], None
    try:
        deadline = max(0.1, cfg.wall_timeout_s - _TRUSTED_MARGIN_S)
        try:
            runner.submit(run_message(tests, deadline, token, cfg.cpu_time_s), [requests_w, replies_r, report_w])
        except (OSError, sb.SandboxUnavailableError) as err:
            return sb.RunResult(sb.RunStatus.SANDBOX_ERROR, None, "", f"the tests' runner: {err}", time.monotonic() - start)
        for fd in (requests_w, replies_r, report_w):
            os.close(fd)
            child_fds.remove(fd)
        if await drains[0].first_byte(cfg.wall_timeout_s) != b"1":
            return sb.RunResult(sb.RunStatus.SANDBOX_ERROR, None, "", "the tests' process did not start",
                                time.monotonic() - start)
        box._populate(workdir, *program_files(program, (replies_w, requests_r), cfg.python), cfg)
        argv, cwd = sb.launch_argv(cfg, workdir, started_w)
        proc = subprocess.Popen(argv, cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                pass_fds=(started_w, requests_r, replies_w), preexec_fn=lambda: sb._set_limits(cfg))
        for fd in (requests_r, replies_w, started_w):
            os.close(fd)
            child_fds.remove(fd)
        kill = lambda: sb._kill_group(proc.pid)  # noqa: E731
        drains[0].on_overflow = kill
        drains += [_Drain(os.dup(pipe.fileno()), cfg.max_output_bytes, kill) for pipe in (proc.stdout, proc.stderr)]
        proc.stdout.close()
        proc.stderr.close()
        return await _supervise(proc, drains, cfg, start, started_r)
    finally:
        for drain in drains:
            drain.close()
        for fd in child_fds:
            os.close(fd)
        if proc is not None and proc.returncode is None:
            sb._kill_group(proc.pid)
            proc.wait()
        os.close(started_r)


async def _supervise(program: subprocess.Popen, drains: list[_Drain], cfg: sb.SandboxConfig, start: float,
                     started_r: int) -> sb.RunResult:
    """Wait for the report pipe to close under the deadline and both sides' output caps, then classify."""
    program_done = asyncio.ensure_future(exited(program.pid))
    try:
        _, pending = await asyncio.wait([drains[0].done], timeout=cfg.wall_timeout_s)
        timed_out = bool(pending)
        program_ended = os.waitid(os.P_PID, program.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        sb._kill_group(program.pid)  # the tests have finished (or the deadline passed): the program has no more to do
        await asyncio.wait([program_done] + [d.done for d in drains[1:]], timeout=5.0)
    finally:
        sb._kill_group(program.pid)
        program_done.cancel()
    program.wait()
    elapsed = time.monotonic() - start
    report, _, stderr = (bytes(d.data) for d in drains)
    report_over, out_over, err_over = (d.over for d in drains)
    cpu_signals = {signal.SIGXCPU, signal.SIGKILL}
    cpu_limit = (program_ended and elapsed >= cfg.cpu_time_s * sb._CPU_LIMIT_SHARE
                 and program.returncode in {-s for s in cpu_signals} | {sb._SIGNAL_EXIT + s for s in cpu_signals})
    if timed_out or cpu_limit:
        status = sb.RunStatus.TIMEOUT
    elif report_over or out_over or err_over:
        status = sb.RunStatus.OUTPUT_LIMIT
    elif not read_all(started_r).startswith(b"1"):
        status = sb.RunStatus.SANDBOX_ERROR
    else:
        status = sb.RunStatus.FINISHED
    return sb.RunResult(status, 0 if status is sb.RunStatus.FINISHED else None, report[1:].decode(errors="replace"),
                        stderr.decode(errors="replace"), elapsed)
