"""Batches sized by measurement (issue 57): each bucket's batches stop at the size where measured
rows/s stops rising on this host, and a call larger than that is cut to it. The server runs in
this process over the fake pool (tests/harness.py) whose batch cost the test sets: a fixed 40 ms
plus a part that grows with the square of the rows (a base model on one CPU core: a big batch
costs more per row), so rows/s peaks at 8 rows and falls after."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.harness import model_repo, serving
from tests.helpers import encoder_request


def cost(rows: int) -> float:
    return 0.040 + 0.0005 * rows * rows


def test_the_cost_curve_peaks_at_8_rows():
    rate = {n: n / cost(n) for n in (1, 2, 4, 8, 16, 32)}  # 24.7, 47.6, 83.3, 111, 95.2, 58.0
    assert max(rate, key=rate.get) == 8 and rate[16] < rate[8] and rate[4] < rate[8]


async def test_batches_stop_where_rows_per_second_stops_rising(tmp_path):
    async with serving(model_repo(tmp_path, {"encoder": ""}), workers_per_device=1) as gw:
        pool = gw.pool("encoder")
        pool.cost = cost
        rng = np.random.default_rng(0)
        # every size once alone, 4 times (a bucket's first batch pays set-up and is not counted)
        for rows in (32, 16, 8, 4, 2, 1):
            for _ in range(4):
                await gw.stub.ModelInfer(encoder_request(rng, rows, 16, {}), timeout=None)
        (latency,) = [rt.scheduler.latency for rt in gw.server.plane.runtimes("encoder")]
        (bucket,) = latency.snapshot()  # one shape bucket: 16 tokens
        (key,) = latency._fits
        assert latency.useful_rows(key) == 8, latency.snapshot()[bucket]
        ran = len(pool.batches)
        # a 32-row call is cut into batches of 8, not run past the peak as one batch of 32
        await gw.stub.ModelInfer(encoder_request(rng, 32, 16, {}), timeout=None)
        assert [b.total for b in pool.batches[ran:]] == [8, 8, 8, 8]
        # 16 callers of 2 rows each: batches of at most 8 rows, and full ones
        ran = len(pool.batches)
        await asyncio.gather(*(
            gw.stub.ModelInfer(encoder_request(rng, 2, 16, {}), timeout=None) for _ in range(16)
        ))  # fmt: skip
        sizes = [b.total for b in pool.batches[ran:]]
        assert sum(sizes) == 32 and max(sizes) == 8, sizes


def _fed(times: dict[int, float], rounds: int = 6):
    from batchgate.gateway.scheduling.latency import LatencyModel

    m = LatencyModel()
    for _ in range(rounds):
        for rows, seconds in times.items():
            m.observe("k", rows, seconds)
    return m


def test_a_limit_moves_only_for_a_clearly_faster_size():
    m = _fed({n: cost(n) for n in (1, 2, 4, 8, 16)})
    assert m.useful_rows("k") == 8
    # 16 rows now measure 5 % more rows a second than 8: within the hysteresis, the limit stays
    for _ in range(30):
        m.observe("k", 8, cost(8))
        m.observe("k", 16, 16 / (1.05 * 8 / cost(8)))
    assert m.useful_rows("k") == 8
    # 25 % more: it moves (rows/s still rises at 16, the largest size measured: at least 16)
    for _ in range(30):
        m.observe("k", 8, cost(8))
        m.observe("k", 16, 16 / (1.25 * 8 / cost(8)))
    assert m.useful_rows("k") >= 16


def test_noise_alone_does_not_learn_a_limit():
    """Sub-millisecond batches on a shared host: times jitter by ±30 %, and a bigger size class can
    come out a few per cent slower per row by chance. Steady times that say the same stop the batch;
    noisy ones must show a clear fall (a limit learned from noise cut the ranker's 5-row calls)."""
    from batchgate.gateway.scheduling.latency import LatencyModel

    rng = np.random.default_rng(1)
    steady, noisy = LatencyModel(), LatencyModel()
    for _ in range(12):
        for rows in (1, 2, 4, 8):
            per_row = 0.0003 * (1.04 if rows >= 4 else 1.0)  # 4 % slower per row from 4 rows on
            steady.observe("k", rows, per_row * rows)
            noisy.observe("k", rows, per_row * rows * rng.uniform(0.7, 1.3))
    assert steady.useful_rows("k") == 1  # steady: no size makes 2 % more rows/s than one row
    limit = noisy.useful_rows("k")
    assert limit is None or limit >= 8, limit  # noisy: a 4 % difference is not a fall
