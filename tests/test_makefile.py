"""The Makefile's install steps, run for real by make against a stand-in .venv whose python, ruff
and batchgate only record how they were called (no network, no install): `make serve` installs the
runtime extra only, `make test` adds the rest, and nothing is installed twice."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*${PYTHONDONTWRITEBYTECODE:+ [bytecode off]}" >> "$CALLS"
case "$*" in
  *"pip show"*) exit 1 ;;  # the other runtime's wheel is not installed
esac
exit 0
"""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.fixture
def checkout(tmp_path) -> Path:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "ruff", "batchgate"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    # `make test` installs redis-server, valgrind and chromium with apt when they are not on PATH,
    # and checkov into a venv of its own when that is missing: give it all of them.
    (tmp_path / "path").mkdir()
    checkov = tmp_path / ".venv-checkov" / "bin"
    checkov.mkdir(parents=True)
    (checkov / "checkov").write_text(STAND_IN)
    (checkov / "checkov").chmod(0o755)
    for tool in ("redis-server", "valgrind", "chromium"):
        (tmp_path / "path" / tool).write_text(STAND_IN)
        (tmp_path / "path" / tool).chmod(0o755)
    return tmp_path


def _make(checkout: Path, *targets: str, env_extra: dict | None = None) -> list[str]:
    calls = checkout / "calls.log"
    calls.write_text("")
    # An outer `make test PYTEST_ARGS=...` hands its variables down through MAKEFLAGS: keep them out.
    outer = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ARGS"}
    env = {k: v for k, v in os.environ.items() if k not in outer | {"PYTHONDONTWRITEBYTECODE"}}
    env.update(env_extra or {})
    env = {**env, "CALLS": str(calls), "PATH": f"{checkout / 'path'}{os.pathsep}{os.environ['PATH']}"}
    # The CPU the Makefile reads (its OpenVINO default): one without BF16 unless a test names one.
    if "CPUINFO" not in env:
        (checkout / "cpuinfo").write_text("flags\t\t: fpu sse4_2 avx2 avx512f avx512_vnni\n")
        env["CPUINFO"] = str(checkout / "cpuinfo")
    out = subprocess.run(
        ["make", "--no-print-directory", *targets, "QUICK_BENCH=0"], cwd=checkout, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return calls.read_text().splitlines()


def _installs(calls: list[str]) -> list[str]:
    return [c for c in calls if "pip install" in c]


def test_serve_then_test_installs_each_part_once(checkout):
    calls = _make(checkout, "serve")
    assert _installs(calls) == ["python -m pip install --no-compile -e .[cpu]"], calls
    assert "batchgate serve" in calls
    assert not any("--quiet" in c or " -q" in c for c in _installs(calls))  # pip's progress stays on

    calls = _make(checkout, "test")
    assert _installs(calls) == ["python -m pip install --no-compile -e .[cpu,test,reference]"], calls
    pytest = next(c for c in calls if c.startswith("python -m pytest"))
    assert re.fullmatch(r"python -m pytest -n [1-9]\d*", pytest), pytest  # xdist on, some workers
    assert "ruff check ." in calls and calls.index("ruff check .") < calls.index(pytest)
    assert "ruff format --check ." in calls  # the format check runs too

    assert _installs(_make(checkout, "serve")) == []  # nothing left to install
    assert _installs(_make(checkout, "test")) == []


def test_the_suite_writes_bytecode_on_a_machine_that_turns_it_off(checkout):
    """Some 200 Python processes run in the suite: without bytecode each compiles what it imports."""
    calls = _make(checkout, "test", env_extra={"PYTHONDONTWRITEBYTECODE": "1"})
    pytest = next(c for c in calls if " -m pytest " in c)
    assert "[bytecode off]" not in pytest, calls
    assert any("[bytecode off]" in c for c in calls), calls  # the install ran with the machine's setting


def test_test_first_leaves_nothing_for_serve(checkout):
    assert _installs(_make(checkout, "test")) == [
        "python -m pip install --no-compile -e .[cpu,test,reference]"
    ]
    assert _installs(_make(checkout, "serve")) == []


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_serve_adds_openvino_where_the_cpu_multiplies_bf16(checkout, flag):
    """There OpenVINO's BF16 is the fastest engine that passes the gate, and the background
    selection chooses only among what is installed; OPENVINO=0 leaves it out, a GPU build never
    has it by default."""
    cpu = checkout / "cpuinfo-bf16"
    cpu.write_text(f"flags\t\t: fpu avx2 avx512f {flag} avx512_vnni\n")
    env = {"CPUINFO": str(cpu)}
    assert _installs(_make(checkout, "serve", env_extra=env)) == [
        "python -m pip install --no-compile -e .[cpu,openvino]"
    ]
    assert _installs(_make(checkout, "serve", env_extra=env)) == []
    assert _installs(_make(checkout, "serve", "OPENVINO=0", env_extra=env)) == [
        "python -m pip install --no-compile -e .[cpu]"
    ]
    (checkout / ".venv" / ".installed-cpu").unlink()
    (checkout / ".venv" / ".installed-cpu-openvino").unlink()
    assert _installs(_make(checkout, "serve", "RUNTIME=gpu", env_extra=env)) == [
        "python -m pip install --no-compile -e .[gpu]"
    ]


def test_a_changed_pyproject_installs_again(checkout):
    _make(checkout, "serve")
    later = time.time() + 2
    os.utime(checkout / "pyproject.toml", (later, later))
    assert _installs(_make(checkout, "serve")) == ["python -m pip install --no-compile -e .[cpu]"]


def test_gpu_runtime_and_format_check(checkout):
    assert _installs(_make(checkout, "serve", "RUNTIME=gpu")) == [
        "python -m pip install --no-compile -e .[gpu]"
    ]
    calls = _make(checkout, "lint", "RUNTIME=gpu", "RUFF_FORMAT=1")
    assert "ruff format --check ." in calls
