"""Local sandbox throughput: programs per second on the default limits (SandboxConfig()).

Runs a short program (`print(sum(range(1000)))`) through `LocalSandbox.run` sequentially and
with `--concurrency` runs in flight, and prints programs/second and the median latency of each.
Each run is a full bwrap start: namespaces, setpriv, a fresh working directory, interpreter
start-up with `-I -S`.

    python benchmarks/sandbox_throughput.py --n 100 --concurrency 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from threepo.services.verifiers.sandbox import LocalSandbox, RunStatus, SandboxConfig

PROGRAM = "print(sum(range(1000)))"


async def measure(sandbox: LocalSandbox, n: int, concurrency: int) -> tuple[float, float]:
    """(programs per second, median latency in seconds) of `n` runs, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one() -> None:
        async with gate:
            start = time.monotonic()
            result = await sandbox.run(PROGRAM)
            latencies.append(time.monotonic() - start)
            if result.status is not RunStatus.FINISHED or result.stdout.strip() != "499500":
                raise RuntimeError(f"benchmark program failed: {result}")

    start = time.monotonic()
    await asyncio.gather(*[one() for _ in range(n)])
    return n / (time.monotonic() - start), statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="programs per measurement")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    sandbox = LocalSandbox(SandboxConfig())
    asyncio.run(measure(sandbox, 5, 1))  # warm the page cache
    for concurrency in (1, args.concurrency):
        rate, median = asyncio.run(measure(sandbox, args.n, concurrency))
        print(f"concurrency {concurrency}: {rate:6.1f} programs/s, median latency "
              f"{median * 1000:.1f} ms ({args.n} programs)")


if __name__ == "__main__":
    main()
