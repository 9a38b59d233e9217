"""Hostile programs against the local sandbox: each is contained, with the right status, and the
test process is unharmed."""

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from threepo.services.verifiers import sandbox as sandbox_mod
from threepo.services.verifiers.sandbox import (LocalSandbox, RunStatus, SandboxConfig,
                                                SandboxUnavailableError)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap missing: apt-get install -y bubblewrap")


def run(code: str, **cfg):
    return asyncio.run(LocalSandbox(SandboxConfig(**cfg)).run(code))


def pids_of_uid(uid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:  # the process exited while we looked
            continue
        uids = next(line for line in text.splitlines() if line.startswith("Uid:")).split()[1:]
        if str(uid) in uids:
            found.append(int(status.parent.name))
    return found


def test_plain_program_runs_as_unprivileged_user_in_its_own_directory():
    r = run("import os, sys; print(os.getuid(), os.getcwd()); print(open('main.py').read()[:6]);"
            "print(__name__, sys.argv)")
    assert r.status is RunStatus.FINISHED and r.return_code == 0
    uid, cwd = r.stdout.split("\n")[0].split()
    cfg = SandboxConfig()
    assert cwd == "/sandbox"
    if os.geteuid() == 0:
        assert cfg.uid <= int(uid) < cfg.uid + cfg.uid_pool_size
    else:
        assert int(uid) == os.geteuid()
    assert "import" in r.stdout and "__main__ ['main.py']" in r.stdout


def test_infinite_loop_hits_cpu_limit_fast():
    start = time.monotonic()
    r = run("while True: pass", cpu_time_s=1, wall_timeout_s=10)
    assert r.status is RunStatus.TIMEOUT
    assert time.monotonic() - start < 5


def test_sleep_past_deadline_kills_whole_group():
    uid = 64000 + os.getpid() % 1000  # a uid of its own, so leftovers are easy to find
    code = "import os, time\nos.fork(); os.fork()\nprint('up', flush=True)\ntime.sleep(60)"
    start = time.monotonic()
    r = run(code, wall_timeout_s=1.0, uid=uid, uid_pool_size=1)
    assert r.status is RunStatus.TIMEOUT
    assert time.monotonic() - start < 4
    if os.geteuid() == 0:
        assert pids_of_uid(uid) == []


def test_fork_bomb_is_contained():
    uid = 63000 + os.getpid() % 1000
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run(code, wall_timeout_s=1.5, max_processes=32, uid=uid, uid_pool_size=1)
    assert r.status is RunStatus.TIMEOUT
    if os.geteuid() == 0:
        assert pids_of_uid(uid) == []
    assert subprocess.run(["true"]).returncode == 0  # we can still fork


def test_concurrent_runs_get_their_own_uids_so_a_fork_bomb_cannot_starve_a_neighbour():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    box = LocalSandbox(SandboxConfig(wall_timeout_s=1.5, max_processes=16, uid_pool_size=4))

    async def both():
        return await asyncio.gather(box.run(bomb), box.run(
            "import os, time\ntime.sleep(0.7)\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
            "os.waitpid(pid, 0)\nprint('forked')"))
    bombed, neighbour = asyncio.run(both())
    assert bombed.status is RunStatus.TIMEOUT
    assert neighbour.status is RunStatus.FINISHED and neighbour.stdout == "forked\n", neighbour.stderr


def test_memory_bomb_gets_memory_error():
    r = run("a = []\nwhile True:\n    a.append(' ' * 10**7)", memory_bytes=256 << 20)
    assert r.status is RunStatus.FINISHED and r.return_code == 1
    assert "MemoryError" in r.stderr


def test_gigabytes_of_output_are_capped_and_fast():
    start = time.monotonic()
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", max_output_bytes=1 << 16)
    assert r.status is RunStatus.OUTPUT_LIMIT
    assert len(r.stdout) == 1 << 16
    assert time.monotonic() - start < 3


def test_network_is_unreachable_inside():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = ("import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('8.8.8.8', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=1); print('CONNECTED')\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)")
    r = run(code)
    listener_got = True
    try:
        listener.accept()
    except BlockingIOError:
        listener_got = False
    listener.close()
    assert r.status is RunStatus.FINISHED
    assert "CONNECTED" not in r.stdout and r.stdout.count("Error") == 2
    assert not listener_got


def test_writes_outside_the_working_directory_fail(tmp_path):
    target = tmp_path / "escape.txt"
    code = ("import os\n"
            f"for path in ['/usr/escape.txt', '/escape.txt', '../escape.txt', {str(target)!r}]:\n"
            "    try:\n"
            "        open(path, 'w').write('x'); print('WROTE', path)\n"
            "    except OSError as e:\n"
            "        print('denied', type(e).__name__)\n"
            "open('inside.txt', 'w').write('ok'); print('inside ok')")
    r = run(code)
    assert "WROTE" not in r.stdout and r.stdout.count("denied") == 4
    assert "inside ok" in r.stdout
    assert not target.exists() and not Path("/usr/escape.txt").exists()


def test_parent_environment_secret_is_not_visible(monkeypatch):
    secret = "hunter2-threepo-fake-secret"
    monkeypatch.setenv("THREEPO_FAKE_SECRET", secret)
    code = ("import os\nprint(dict(os.environ))\n"
            "for p in ['/proc/1/environ', '/proc/self/environ', f'/proc/{os.getppid()}/environ']:\n"
            "    try:\n"
            "        print(open(p, 'rb').read())\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)")
    r = run(code)
    assert r.status is RunStatus.FINISHED
    assert secret not in r.stdout and secret not in r.stderr
    assert "THREEPO_FAKE_SECRET" not in r.stdout


def test_signalling_the_parent_fails():
    me = os.getpid()
    code = ("import os, signal\n"
            f"for pid in [{me}, os.getppid(), 1, -1]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL); print('SENT', pid)\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)")
    r = run(code)
    assert r.status is RunStatus.FINISHED
    assert f"SENT {me}" not in r.stdout and "SENT 1" not in r.stdout
    os.kill(me, 0)  # still here


def test_stdin_is_closed_and_files_are_written():
    r = asyncio.run(LocalSandbox().run("import sys; print(repr(sys.stdin.read()), open('d/x').read())",
                                       files={"d/x": b"data"}))
    assert r.stdout.strip() == "'' data"
    r = asyncio.run(LocalSandbox().run("print(input()[::-1])", stdin="abc\n"))
    assert r.stdout.strip() == "cba"
    with pytest.raises(ValueError, match="files"):
        asyncio.run(LocalSandbox().run("pass", files={"../x": b""}))


def test_missing_bwrap_refuses_unless_unconfined_is_asked_for(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        asyncio.run(LocalSandbox().run("print(1)"))
    with caplog.at_level(logging.WARNING):
        box = LocalSandbox(SandboxConfig(isolation="unconfined"))
    assert "UNCONFINED" in caplog.text and "NO network isolation" in caplog.text
    r = asyncio.run(box.run("import os; print(sorted(set(os.environ) - {'LC_CTYPE'}))"))
    assert r.status is RunStatus.FINISHED and r.stdout.strip() == "[]"


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="SandboxConfig.isolation"):
        SandboxConfig(isolation="docker")
    with pytest.raises(ValueError, match="SandboxConfig.uid"):
        SandboxConfig(uid=0)
    with pytest.raises(ValueError, match="SandboxConfig.wall_timeout_s"):
        SandboxConfig(wall_timeout_s=0)


def test_cancelled_run_leaves_no_process_behind():
    uid = 62000 + os.getpid() % 1000

    async def cancel_soon(delay):
        task = asyncio.ensure_future(LocalSandbox(SandboxConfig(uid=uid, uid_pool_size=1)).run(
            "import os, time\nos.fork()\ntime.sleep(60)"))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for delay in (0.0, 0.001, 0.3):  # during setup and while running
        start = time.monotonic()
        asyncio.run(cancel_soon(delay))
        assert time.monotonic() - start < 3
        if os.geteuid() == 0:
            time.sleep(0.1)
            assert pids_of_uid(uid) == []
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline")
                if p.exists() and b"threepo-sandbox" in _safe_read(p)]


def _safe_read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process exited while we looked
        return b""


LOOK_AROUND = ("import os, sys\nprint(sorted(os.listdir('/')))\n"
               "print([p for p in ('/root', '/home', '/etc', '/tmp', '/var', {host!r}) if os.path.exists(p)])\n"
               "print(sys.executable, os.environ.get('HOME'), os.environ.get('TMPDIR'))\n"
               "for p in ('/opt/python/x', '/usr/x', '/x'):\n"
               "    try:\n        open(p, 'w'); print('WROTE', p)\n"
               "    except OSError:\n        pass\n")


@pytest.mark.parametrize("python", [None, "/usr/bin/python3"])
def test_the_filesystem_inside_is_what_the_docs_say(python):
    if python is not None and not os.path.exists(python):
        pytest.skip(f"{python} not installed")
    cfg = SandboxConfig() if python is None else SandboxConfig(python=python)
    prefix, inside_exe = sandbox_mod.interpreter_paths(cfg.python)
    r = run(LOOK_AROUND.format(host=os.path.dirname(os.path.abspath(__file__))), **(
        {} if python is None else {"python": python}))
    assert r.status is RunStatus.FINISHED and r.return_code == 0, r.stderr
    listing, present, where = r.stdout.splitlines()[:3]
    host_tops = {t for t in ("bin", "lib", "lib64", "lib32", "libx32") if os.path.lexists(f"/{t}")}
    expected = {"usr", "proc", "dev", "sandbox"} | host_tops | ({"opt"} if prefix else set())
    assert set(eval(listing)) == expected  # no /root, /home, /etc, /tmp, /var, no host paths
    assert eval(present) == []
    assert where == f"{inside_exe} /sandbox /sandbox" and "WROTE" not in r.stdout


def test_the_interpreter_is_stated_and_is_the_configured_one():
    import platform

    version = subprocess.run([os.path.realpath(sys.executable), "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True).stdout.strip()
    stated = asyncio.run(LocalSandbox().interpreter())
    assert stated == f"{platform.python_implementation()} {version} {sandbox_mod.interpreter_paths(sys.executable)[1]}"
    if os.path.exists("/usr/bin/python3"):
        system = subprocess.run(["/usr/bin/python3", "-c", "import platform; print(platform.python_version())"],
                                capture_output=True, text=True).stdout.strip()
        other = asyncio.run(LocalSandbox(SandboxConfig(python="/usr/bin/python3")).interpreter())
        assert other.split()[1] == system and other.split()[2].startswith("/usr/bin/python3")
