"""Runs of similar length (workers/runs.py): the cut of a padded batch and the measured cost of
a run it rests on. The engine's use of them is checked on a real model in test_token_embeddings."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from batchgate.workers.runs import RunCost, partition


def cost(groups, lengths, overhead):
    return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)


def cheapest(lengths, overhead):
    """Every contiguous cut of the sorted rows, tried."""
    s = sorted(lengths)
    best = float("inf")
    for k in range(len(s)):
        for cuts in itertools.combinations(range(1, len(s)), k):
            edges = (0, *cuts, len(s))
            best = min(best, sum(overhead + (b - a) * s[b - 1] for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_cut_is_the_cheapest_and_covers_every_row_once(seed):
    rng = random.Random(seed)
    lengths = np.array([rng.choice([3, 5, 6, 9, 14, 16, 30, 31, 120, 347]) for _ in range(rng.randint(2, 9))])
    overhead = rng.choice([0.0, 2.0, 8.0, 40.0, 500.0])
    groups = partition(lengths, overhead)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    assert cost(groups, lengths, overhead) == pytest.approx(cheapest(lengths.tolist(), overhead))
    for g in groups:  # each run's rows ascending, so its last is its width
        assert list(lengths[g]) == sorted(lengths[g])


def test_free_runs_cut_at_every_length_and_dear_ones_not_at_all():
    lengths = np.array([9, 3, 9, 40, 3, 12])
    assert sorted(sorted(lengths[g].tolist()) for g in partition(lengths, 0.0)) == [
        [3, 3],
        [9, 9],
        [12],
        [40],
    ]
    assert [len(g) for g in partition(lengths, 1e6)] == [6]


def test_the_cost_of_a_run_is_measured_from_small_runs():
    cost = RunCost(default=8.0)
    a, b = 0.004, 0.0005  # a run: 8 tokens' worth
    for i in range(RunCost.MIN_RUNS - 1):
        cost.observe(16 * (1 + i % 5), a + b * 16 * (1 + i % 5))
    assert cost.overhead_tokens() == 8.0  # not enough runs yet: the default
    cost.observe(48, a + b * 48)
    assert cost.overhead_tokens() == pytest.approx(a / b)
    cost.observe(RunCost.SMALL + 1, 100.0)  # a long run says nothing about the overhead
    assert cost.overhead_tokens() == pytest.approx(a / b)
    for _ in range(300):  # the host got dearer per run: the fit follows
        for n in (16, 64, 256):
            cost.observe(n, 0.02 + b * n)
    assert cost.overhead_tokens() == pytest.approx(0.02 / b, rel=0.02)


def test_no_default_means_no_cut_until_measured_and_same_sized_runs_teach_nothing():
    cost = RunCost(default=None)
    for _ in range(50):
        cost.observe(64, 0.01)
    assert cost.overhead_tokens() is None
