"""ClusterLimiter: two handles of one name share one set of permits; a lost holder's permit comes
back when its lease runs out."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.ray


def test_limiter_is_shared_by_name_and_leases_expire(ray_session):
    from threepo.deploy.limiter import ClusterLimiter

    a = ClusterLimiter("test-limiter", capacity=2, lease_s=1.0)
    b = ClusterLimiter("test-limiter", capacity=99)  # same actor: the first capacity wins
    in_flight, peak = 0, 0

    async def hold(limiter):
        nonlocal in_flight, peak
        async with limiter:
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0.1)
            in_flight -= 1

    async def main():
        await asyncio.gather(*[hold(x) for x in (a, b, a, b, a, b)])
        await a.__aenter__()  # a holder that never releases (as if its process died)
        await a.__aenter__()
        start = time.monotonic()
        async with b:  # waits for a lease to run out
            waited = time.monotonic() - start
        return waited
    waited = asyncio.run(main())
    assert peak == 2
    assert 0.5 < waited < 5
    ray_session.kill(ray_session.get_actor("test-limiter", namespace="threepo"))
