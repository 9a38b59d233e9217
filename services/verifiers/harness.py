"""The test harness of `code_tests`: the tests run in a trusted process, the program in its own, and
only plain data crosses between them (services/verifiers/plain_data.py).

`program_files(program, fds, python)` and `runner_source(sock_fd)` are what `split_run.run_tests` runs
(locally and in the sandbox service alike: one harness, one rule), `run_message(...)` what it hands
the runner for one run:

- **the program's side** (main.py in the sandbox, its own PID namespace; the program itself is
  program.py beside it, never spliced into the harness's text): runs the program, tells the
  trusted side which top-level names it defined (callables, stdlib modules, plain-data values), then
  serves calls — reads `[name, args, kwargs]` from the request pipe, calls the program's function and
  answers `["return", result, args after, kwargs after]` or `["raise", type name, message, ...]`
  (any exception, SystemExit included), or `["not_plain", reason]` when the result is not plain data;
- **the trusted side** (a child of the trusted runner, in a sandbox of its own: the program can
  neither see it nor reach its memory): takes the tests, the deadline and a fresh token, waits for the
  program's names, makes each callable one a proxy, runs the test statements in turn with the
  builtins of its own process, and writes one report line `<token> <verdict> <done>/<total> <detail>`.

A proxy sends the call's arguments, which must be plain data (written with `marshal`, which refuses
subclasses and other objects; the program's side reads them with it), and returns the result decoded
strictly (`plain_data.decode`: the program's side may send anything): a new
object of the tests' process, compared there, so neither an `__eq__` of the program's making nor a
subclass of a plain type ever reaches a test. A program's exception arrives as its type name and
message and is raised on the trusted side as that builtin exception (a test may expect a ValueError),
or as `ProgramError` when the type is not a builtin one. A list, dict or set argument the program
changed in place is changed in place on the trusted side too, from the copy the program's side sends
back (its top level; nested objects are replaced by their new values). Time: the run's deadline is
the trusted side's; a call, or the program's start, still running at it ends the run as `timeout`,
naming the call. A program's process that ends during a call, or answers out of protocol, ends the
run as `error` at that test. Names: a program's name that is also a builtin's (`len`, `isinstance`)
is not given to the tests; neither is anything but a callable, a stdlib module (imported afresh on the
trusted side) or a plain-data value.

    passed n/n                      -> ok
    wrong i/n    (AssertionError in test i, whatever its message)      -> wrong
    error i/n    (another exception in test i)                        -> runtime_error
    timeout i/n  (the deadline passed in a call of test i)             -> timeout
    program 0/n  (the program raised or exited before the tests)      -> runtime_error
    no report line carrying the token                                 -> runtime_error (or timeout,
                                                                         output limit as the run says)

What this holds against (each has a test in tests/services/test_code_harness.py or
test_code_redteam.py): everything that needs the tests' process — reading the token or the expected values out of frames, the heap, other
threads or /proc, a trace or profile function, replaced builtins or module attributes, exit hooks,
signals, closing or forging the report — since none of it is in the program's process; early exits
of any kind (the program's process ending is an error, never a pass); values that defeat the tests'
comparisons (always-equal objects, subclasses of str, int, list, ...: not plain data); forged frames
on the pipe (decoded strictly: only plain data, only the protocol's shapes).

What it does not hold against: a kernel or sandbox escape (the sandbox's docstring), a program that
computes the right answers by other means (that is a correct program), and tests that hand the
program objects which are not plain data (such a test fails: `not plain data`, naming the type).
Under `isolation="unconfined"` the two processes share a uid and a PID namespace, and the program
can reach the trusted one: use it only for trusted code. Arguments the tests pass travel by
`marshal`, which also writes Ellipsis and code objects; the program receives those as they are.
"""

from __future__ import annotations

import functools
import marshal
import os
import re
import secrets
import sys
from pathlib import Path

from threepo.services.verifiers.plain_data import encode

_VERDICTS = ("passed", "wrong", "error", "timeout", "program")
_DETAIL_CHARS = 300
_CODEC = Path(__file__).with_name("plain_data.py").read_text()

# The program's side: reads requests on one pipe, writes replies on another (fds filled in).
_PROGRAM_SIDE = '''\
def _threepo_program_side(program, fds):
    import builtins, marshal, os, sys
    end, exc_info, module, loads = os._exit, sys.exc_info, type(sys), marshal.loads
    send_frame, receive_frame = _frames(fds)

    def why():
        kind, value = exc_info()[:2]
        try:
            text = "".join(str(value))
        except BaseException:
            text = "<unprintable>"
        return getattr(kind, "__name__", "?"), text

    def send(message):
        try:
            send_frame(encode(message).encode("utf-8", "surrogatepass"))
        except NotPlain as err:
            send_frame(encode(["not_plain", str(err)]).encode("utf-8", "surrogatepass"))

    scope = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
    try:
        exec(compile(program, "main.py", "exec"), scope)
    except SystemExit:
        send(["failed", "SystemExit before the tests ran"])
        end(1)
    except BaseException:
        kind, text = why()
        send(["failed", "%s: %s" % (kind, text) if text else kind])
        end(1)
    names = {}
    for name, value in list(scope.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, module):
            names[name] = ["module", value.__name__]
        elif callable(value):
            names[name] = ["call"]
        else:
            try:
                encode(value)
                names[name] = ["value", value]
            except NotPlain:
                pass
    send(["loaded", names])
    while True:
        request = receive_frame()
        if request is None:
            end(0)
        name, args, kwargs = loads(request)  # the trusted side's own marshal of plain data
        try:
            result = scope[name](*args, **kwargs)
        except BaseException:
            send(["raise", *why(), args, kwargs])
        else:
            send(["return", result, args, kwargs])

'''

# The trusted side of one run: writes requests on fds[0], reads replies on fds[1], reports on fd 1.
_TRUSTED_SIDE = '''\
def _threepo_trusted_side(tests, deadline_s, fds, token):
    import builtins, importlib, marshal, os, sys, time
    end, exc_info, clock, dumps = os._exit, sys.exc_info, time.monotonic, marshal.dumps
    deadline = clock() + deadline_s
    send_frame, receive_frame = _frames(fds, lambda: max(0.0, deadline - clock()))
    at = [0]

    def report(verdict, done, detail=""):
        line = "\\n%s %s %d/%d %s\\n" % (token, verdict, done, len(tests), detail[:300].replace("\\n", " | "))
        try:
            os.write(1, line.encode("utf-8", "replace"))
        finally:
            end(0 if verdict == "passed" else 1)

    def why():
        kind, value = exc_info()[:2]
        text = str(value)
        return "%s: %s" % (kind.__name__, text) if text else kind.__name__

    def reply(what):
        try:
            frame = receive_frame()
        except TimeoutError:
            report("timeout", at[0], "deadline (%gs) passed %s" % (deadline_s, what))
        except NotPlain as err:
            report("error", at[0], "the program's process answered out of protocol %s: %s" % (what, err))
        if frame is None:
            report("program" if what == "while the program started" else "error", at[0],
                   "the program's process ended %s" % what)
        try:
            return decode(frame.decode("utf-8", "surrogatepass"))
        except (NotPlain, UnicodeError) as err:
            report("error", at[0], "the program's process answered out of protocol %s: %s" % (what, err))

    class ProgramError(Exception):
        """An exception of the program's whose type is not a builtin one: 'Type: message'."""

    def write_back(given, after):
        for old, new in zip(given, after):
            if type(old) is list and type(new) is list:
                old[:] = new
            elif type(old) in (dict, set) and type(new) is type(old):
                old.clear()
                old.update(new)

    def proxy_of(name):
        def proxy(*args, **kwargs):
            try:
                send_frame(dumps([name, list(args), kwargs], 2))  # marshal refuses subclasses and objects
            except ValueError:
                try:
                    encode([list(args), kwargs])
                    reason = "not plain data"
                except NotPlain as err:
                    reason = str(err)
                raise TypeError("%s(...): an argument is not plain data: %s" % (name, reason)) from None
            except OSError:
                report("error", at[0], "the program's process ended before a call to %s" % name)
            answer = reply("in a call to %s" % name)
            shape = [type(x) for x in answer] if type(answer) is list else []
            if shape[:1] == [str] and answer[0] == "return" and shape[2:] == [list, dict] and len(shape) == 4:
                write_back(args, answer[2])
                write_back([kwargs[k] for k in kwargs], [answer[3].get(k) for k in kwargs])
                return answer[1]
            if shape == [str, str, str, list, dict] and answer[0] == "raise":
                write_back(args, answer[3])
                write_back([kwargs[k] for k in kwargs], [answer[4].get(k) for k in kwargs])
                kind = getattr(builtins, answer[1], None) if answer[1].isidentifier() else None
                if isinstance(kind, type) and issubclass(kind, Exception):
                    raise kind(answer[2])
                raise ProgramError("%s: %s" % (answer[1], answer[2]) if answer[2] else answer[1])
            if shape == [str, str] and answer[0] == "not_plain":
                raise TypeError("%s returned a value that is not plain data: %s" % (name, answer[1]))
            report("error", at[0], "the program's process answered out of protocol in a call to %s" % name)
        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    try:
        codes = [compile(t, "test_%d" % i, "exec") for i, t in enumerate(tests)]
    except BaseException:
        report("error", 0, "the tests do not compile: " + why())
    loaded = reply("while the program started")
    if type(loaded) is list and len(loaded) == 2 and loaded[0] == "failed" and type(loaded[1]) is str:
        report("program", 0, loaded[1])
    if not (type(loaded) is list and len(loaded) == 2 and loaded[0] == "loaded" and type(loaded[1]) is dict):
        report("program", 0, "the program's process answered out of protocol as it started")
    scope = {"__name__": "__main__", "__builtins__": builtins}
    for name, info in loaded[1].items():
        if type(name) is not str or not name.isidentifier() or hasattr(builtins, name) or type(info) is not list:
            continue  # a program's `len` is not the tests' len
        if info == ["call"]:
            scope[name] = proxy_of(name)
        elif len(info) == 2 and info[0] == "value":
            scope[name] = info[1]
        elif len(info) == 2 and info[0] == "module" and info[1] in sys.stdlib_module_names:
            try:
                scope[name] = importlib.import_module(info[1])
            except ImportError:
                pass
    for i, code in enumerate(codes):
        at[0] = i
        try:
            exec(code, scope)
        except AssertionError:
            report("wrong", i, why())
        except SystemExit:
            report("error", i, "SystemExit inside the tests")
        except BaseException:
            report("error", i, why())
    report("passed", len(codes))
'''

# The trusted runner: a long-lived process (in a sandbox of its own) that forks one child per run.
# A run arrives on the socket `sock_fd` as the name of a file in its directory holding [tests,
# deadline, token, CPU seconds] and three fds (requests out, replies in, report out); the child
# writes "1" on the report pipe (it started), then runs the trusted side with its fd 1 on that pipe.
_RUNNER = '''\
def _threepo_trusted_runner(sock_fd):
    import builtins, importlib, marshal, os, resource, signal, socket, sys, time  # the children's imports, once
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    sock = socket.socket(fileno=sock_fd)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 4096, 3)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)  # the sandbox that started it is gone
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            try:
                sock.close()
                requests, replies, report = fds
                os.write(report, b"1")
                os.dup2(report, 1)
                os.dup2(report, 2)
                path = message.decode("utf-8")
                with open(path, "rb") as f:
                    tests, deadline, token, cpu_s = decode(f.read().decode("utf-8", "surrogatepass"))
                os.unlink(path)
                resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
                signal.alarm(int(deadline) + 2)  # a backstop: the run's own deadline ends it sooner
                _threepo_trusted_side(tests, deadline, (requests, replies), token)
            finally:
                os._exit(1)  # the trusted side ends the child itself; this only when it could not run
        for fd in fds:
            os.close(fd)


_threepo_trusted_runner({sock!r})
'''

# Length-prefixed frames on a pair of pipes, shared by both sides; `remaining` bounds each wait.
_FRAMES = '''\
MAX_FRAME = 16 << 20


def _frames(fds, remaining=None):
    import os, select
    out_fd, in_fd = fds
    read, write = os.read, os.write

    buffer = bytearray()

    def exactly(n):  # n bytes from the pipe, reading ahead into `buffer` (one read a frame, mostly)
        while len(buffer) < n:
            if remaining is not None and not select.select([in_fd], [], [], remaining())[0]:
                raise TimeoutError
            chunk = read(in_fd, max(1 << 16, min(n - len(buffer), 1 << 20)))
            if not chunk:
                return None
            buffer.extend(chunk)
        data = bytes(buffer[:n])
        del buffer[:n]
        return data

    def send_frame(data):
        data = len(data).to_bytes(8, "big") + data
        while data:
            data = data[write(out_fd, data):]

    def receive_frame():
        header = exactly(8)
        if header is None:
            return None
        size = int.from_bytes(header, "big")
        if size > MAX_FRAME:
            raise NotPlain("a frame of %d bytes (at most %d)" % (size, MAX_FRAME))
        return exactly(size)

    return send_frame, receive_frame
'''


def new_token() -> str:
    """A fresh report token: 128 random bits, hex."""
    return secrets.token_hex(16)


def _fill(template: str, literals: dict[str, str]) -> str:
    body = re.sub(r"\{(sock)!r\}", lambda m: literals[m.group(1)], template)
    return _CODEC + "\n\n" + _FRAMES + "\n\n" + body


def program_files(program: str, fds: tuple[int, int], python: str) -> tuple[str, dict[str, bytes]]:
    """The program's side as (main.py, the files beside it): runs `program` (program.py), then
    serves the trusted side's calls; `fds`: (replies out, requests in) as the program's process has
    them. For the interpreter running this process (`python`, the sandbox's default) the harness
    goes compiled (harness.bin, marshal: its compile is ~2 ms of each program's start), else as source."""
    files = {"program.py": program.encode("utf-8")}
    call = f"_threepo_program_side(open('program.py', encoding='utf-8').read(), {tuple(fds)!r})\n"
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        files["harness.bin"] = _compiled_program_side()
        return "import marshal\nexec(marshal.loads(open('harness.bin', 'rb').read()))\n" + call, files
    return _fill(_PROGRAM_SIDE, {}) + "\n\n" + call, files


@functools.cache
def _compiled_program_side() -> bytes:
    return marshal.dumps(compile(_fill(_PROGRAM_SIDE, {}), "harness.py", "exec"))


def runner_source(sock_fd: int) -> str:
    """The trusted runner, taking runs on the socket `sock_fd` (see `run_message`)."""
    return _fill(_TRUSTED_SIDE + "\n\n" + _RUNNER, {"sock": repr(sock_fd)})


def run_message(tests: tuple[str, ...] | list[str], deadline_s: float, token: str, cpu_time_s: int) -> bytes:
    """What the trusted runner reads for one run (from a file in its directory): the tests, the
    seconds they may take, the report token, the child's CPU-time limit."""
    return encode([tuple(tests), float(deadline_s), token, int(cpu_time_s)]).encode("utf-8", "surrogatepass")


def read_report(stdout: str, token: str) -> tuple[str, int, int, str] | None:
    """(verdict, done, total, detail) from the last report line carrying `token`, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(token + " "):
            parts = line[len(token) + 1:].split(" ", 2)
            if len(parts) >= 2 and parts[0] in _VERDICTS and "/" in parts[1]:
                done, _, total = parts[1].partition("/")
                if done.isdigit() and total.isdigit():
                    return parts[0], int(done), int(total), (parts[2] if len(parts) > 2 else "")[:_DETAIL_CHARS]
    return None


def without_report(stdout: str, token: str) -> str:
    """`stdout` without the harness's report line (what was printed beside it)."""
    return "\n".join(line for line in stdout.splitlines() if not line.startswith(token + " "))
