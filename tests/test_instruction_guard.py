"""The CI regression guard (bench/instructions.py): instructions per row under callgrind against the
committed baseline; and a faked 20 % regression (the ranker run 6 times, counted as 5) is caught."""

from __future__ import annotations

import re

import pytest

from batchgate.bench import instructions as guard

pytestmark = pytest.mark.skipif(guard.available() is not None, reason=str(guard.available()))


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict[str, float]:
    models = guard.build_models(tmp_path_factory.mktemp("guard"))
    figs = guard.measure(models)
    figs["_models"] = models  # for the faked regression below
    return figs


def _report(figs: dict) -> str:
    return ", ".join(f"{k} {v:,.0f}" for k, v in figs.items() if not k.startswith("_"))


def test_instructions_per_row_hold_the_baseline(figures):
    figs = {k: v for k, v in figures.items() if not k.startswith("_")}
    print(f"\ninstructions per row ({guard.machine_key()}): {_report(figs)}")
    base = guard.load_baseline()
    if base is None:
        pytest.skip(
            f"no baseline for {guard.machine_key()} in {guard.BASELINE.name}; figures: {_report(figs)}"
        )
    assert set(figs) <= set(base), f"cases without a baseline: {sorted(set(figs) - set(base))}"
    assert guard.compare(figs, base) == []


def test_a_20_percent_regression_fails(figures):
    kind, runs, rows = guard.CASES["ranker/fp32"]
    slower = guard.count(figures["_models"]["ranker/fp32"], kind, runs + 1) / (runs * rows)  # 6/5 = +20 %
    bad = guard.compare({"ranker/fp32": slower}, {"ranker/fp32": figures["ranker/fp32"]})
    assert len(bad) == 1 and re.search(r"ranker/fp32: .* \(\+(19|20)\.\d%, allowed \+10%\)", bad[0]), bad
    assert (
        guard.compare({"ranker/fp32": figures["ranker/fp32"]}, {"ranker/fp32": figures["ranker/fp32"]}) == []
    )
