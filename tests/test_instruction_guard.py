"""The CI regression guard (lab/instructions.py): instructions per row under callgrind against the
committed baseline, bare sessions and batchgate's own engine path (buckets, bound buffers, a batch
split); and a faked 20 % regression (the ranker run 6 times, counted as 5) is caught.

Outside CI a machine the guard cannot measure or compare (no valgrind, no baseline for its key, no
minilm) skips, saying why. In CI (env ``CI`` set, as CI services set it) each of
those fails instead: a guard that skips there guards nothing. A CI host whose key has no baseline
(a new ISA level under valgrind, another ORT version) fails until one is recorded on it with
``python -m lab.instructions --update`` and the baseline file committed.
"""

from __future__ import annotations

import os
import re

import pytest

from lab import instructions as guard


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _cannot(why: str) -> None:
    """Fail in CI, skip elsewhere, with the same reason."""
    if in_ci():
        pytest.fail(f"CI: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict:
    if (why := guard.available()) is not None:
        _cannot(why)
    models, missing = guard.build_models(tmp_path_factory.mktemp("guard"))
    # the faked regression below is counted in the same child: the ranker run 6 times
    runs = guard.CASES["ranker/fp32"][1]
    figs: dict = guard.measure(models, extra={"ranker/fp32": runs + 1})
    figs["_slower"] = figs.pop(f"ranker/fp32+{runs + 1}")
    figs["_missing"] = missing
    return figs


def _report(figs: dict) -> str:
    return ", ".join(f"{k} {v:,.0f}" for k, v in figs.items() if not k.startswith("_"))


def test_instructions_per_row_hold_the_baseline(figures):
    figs = {k: v for k, v in figures.items() if not k.startswith("_")}
    print(f"\ninstructions per row ({guard.machine_key()}): {_report(figs)}")
    base = guard.load_baseline()
    if base is None:
        _cannot(
            f"no baseline for {guard.machine_key()} in lab/baselines/{guard.BASELINE.name}; figures: "
            f"{_report(figs)}; record one on this host with `.venv/bin/python -m lab.instructions "
            "--update` and commit the file"
        )
    assert set(figs) <= set(base), f"cases without a baseline: {sorted(set(figs) - set(base))}"
    assert guard.compare(figs, base) == []


def test_every_case_is_counted_minilm_int8_included(figures):
    """The served model's INT8 is counted beside the bundled ones: a regression that only a real-size
    model shows (its 24 GEMMs) is guarded too."""
    if figures["_missing"]:
        _cannot("; ".join(f"{k} not counted: {why}" for k, why in figures["_missing"].items()))
    assert set(guard.CASES) == {k for k in figures if not k.startswith("_")}
    assert figures["minilm/int8"] > 10 * figures["encoder/int8"], figures  # 67 M against 4 M a row
    # batchgate's engine pads 6 rows of 9 to 29 tokens to the 32 bucket and 2 padding rows: 8 rows
    # of a 32-token row's work for 6 (measured 4.21 M a row, against 3.42 M a 32-token row alone);
    # padding every batch to the largest bucket (256) costs 8x that
    assert figures["encoder/engine"] < 1.5 * figures["encoder/fp32"], figures


def test_a_20_percent_regression_fails(figures):
    _, runs, _ = guard.CASES["ranker/fp32"]
    slower = figures["_slower"] * (runs + 1) / runs  # 6 runs counted as 5: +20 %
    bad = guard.compare({"ranker/fp32": slower}, {"ranker/fp32": figures["ranker/fp32"]})
    assert len(bad) == 1 and re.search(r"ranker/fp32: .* \(\+(19|20)\.\d%, allowed \+10%\)", bad[0]), bad
    assert (
        guard.compare({"ranker/fp32": figures["ranker/fp32"]}, {"ranker/fp32": figures["ranker/fp32"]}) == []
    )
