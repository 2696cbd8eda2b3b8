"""The host's best engine by default (gateway/selection.py, issue 57): a model with no variant
chosen for this host's CPU class serves the original at once, selects in a niced child process,
switches through the reload path without dropping a call, and records the choice per CPU class;
the next start on the class loads it directly, another class measures for itself, and the setting
off (or the model's parameter, or a pinned variant) keeps what the config says.

The server is the real one in this process over the fake pool (tests/harness.py): what is under
test is the selection's life cycle and the switch, not the engines. One test runs the real child
(``python -m batchgate.gateway.selection``: optimize --auto over the bundled encoder, one
candidate); the switch itself is driven by a stand-in child that records a prepared variant, so a
switch happens whatever this CPU finds fastest."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from batchgate.gateway.repository import build_path, remove_builds, report_path, sha256_file, variant_path
from batchgate.gateway.selection import RECORD_FILE, read_record, recorded, write_entry
from batchgate.workers.devices import host_class
from tests.conftest import start_server
from tests.harness import REPO, serving
from tests.helpers import encoder_request

ZEN4 = """vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16 sse4_2
"""
SAPPHIRE = """vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8
"""


def test_the_host_class_names_vendor_family_model_and_the_flags_that_matter():
    assert host_class(ZEN4) == "AuthenticAMD-25-17-avx2+avx512_bf16+avx512_vnni+avx512f"
    assert host_class(SAPPHIRE) == "GenuineIntel-6-143-amx_bf16+amx_int8+avx2+avx512_bf16+avx512_vnni+avx512f"
    # the same family and flags on another model is another class (its kernels' speed differs)
    assert host_class(ZEN4.replace("model\t\t: 17", "model\t\t: 97")) != host_class(ZEN4)
    assert host_class(ZEN4.replace(" avx512_bf16", "")) != host_class(ZEN4)
    assert host_class(ZEN4.replace(" sse4_2", "")) == host_class(ZEN4)  # a flag that does not matter


def _repo(root: Path, extra: str = "", max_batch_size: int = 64) -> Path:
    """A repository holding a real copy of the bundled encoder (the selection writes beside it)."""
    d = root / "repo" / "encoder"
    (d / "1").mkdir(parents=True)
    shutil.copy(REPO / "encoder" / "1" / "model.onnx", d / "1" / "model.onnx")
    config = (REPO / "encoder" / "config.pbtxt").read_text()
    if max_batch_size != 64:
        config = config.replace("max_batch_size: 64", f"max_batch_size: {max_batch_size}")
        config = config.replace("preferred_batch_size: [ 16, 32 ]", "preferred_batch_size: [ 4 ]")
        config = config.replace('"1,2,3,4,6,8,12,16,24,32,48,64"', '"1,2,3,4"')
    (d / "config.pbtxt").write_text(config + extra)
    return root / "repo"


def _prepare_optimized(model_dir: Path) -> None:
    """A servable 'optimized' variant (a copy of the original with a passing report): what a
    selection could have chosen, without building one."""
    src = model_dir / "1" / "model.onnx"
    dst = variant_path(src, "optimized")
    shutil.copy(src, dst)
    report_path(src, "optimized").write_text(json.dumps({
        "status": "passed", "failures": [],
        "original": {"sha256": sha256_file(src)}, "variant": {"sha256": sha256_file(dst)},
    }))  # fmt: skip


def _entry(model_dir: Path, variant: str, cls: str) -> dict:
    return {"variant": variant, "status": "chosen", "why": "prepared by the test", "x_original": 1.5,
            "original_sha256": sha256_file(model_dir / "1" / "model.onnx"), "host_class": cls,
            "report": "1/model.auto.report.md", "date": "2026-12-07", "seconds": 1.0}  # fmt: skip


def test_a_choice_is_read_back_for_its_own_class_only_and_while_it_holds(tmp_path):
    model_dir = _repo(tmp_path) / "encoder"
    _prepare_optimized(model_dir)
    src = model_dir / "1" / "model.onnx"
    write_entry(model_dir, "1", _entry(model_dir, "optimized", "A"), "A")
    write_entry(model_dir, "1", _entry(model_dir, "fp32", "B"), "B")
    assert recorded(model_dir, "1", src, "A")["variant"] == "optimized"
    assert recorded(model_dir, "1", src, "B")["variant"] == "fp32"  # the other class's kept
    assert recorded(model_dir, "1", src, "C") is None  # a class with no entry measures for itself
    assert recorded(model_dir, "2", src, "A") is None  # per version
    report_path(src, "optimized").write_text(json.dumps({"status": "failed", "failures": ["x"]}))
    assert recorded(model_dir, "1", src, "A") is None  # the variant no longer serves
    src.write_bytes(src.read_bytes() + b"\0")
    assert recorded(model_dir, "1", src, "B") is None  # another original: measured again


def _state(gw) -> dict:
    return gw.server.plane.get("encoder").selection


async def _load(gw, stop: asyncio.Event, errors: list, pause_s: float = 0.0) -> int:
    """Calls one after another until ``stop``: each must be answered (counted), none refused."""
    rng = np.random.default_rng(0)
    n = 0
    while not stop.is_set():
        try:
            await gw.stub.ModelInfer(encoder_request(rng, 2, 16, {}), timeout=30)
            n += 1
        except Exception as exc:  # noqa: BLE001 - every failure is the finding
            errors.append(exc)
        if pause_s:
            await asyncio.sleep(pause_s)
    return n


STAND_IN = """
import sys, time
from pathlib import Path
sys.path.insert(0, ROOT)
from batchgate.gateway.selection import write_entry
from batchgate.workers.devices import host_class
from tests.test_selection import _entry
model_dir = Path(sys.argv[1])
for i in range(3):
    print("stand-in: step", i, flush=True)
    time.sleep(0.2)
write_entry(model_dir, "1", _entry(model_dir, "optimized", host_class()))
"""


async def test_the_switch_to_the_winner_drops_no_call(tmp_path):
    repo = _repo(tmp_path, max_batch_size=4)  # 2 workers x 2 calls a batch: 8 callers keep 4 queued
    model_dir = repo / "encoder"
    _prepare_optimized(model_dir)
    script = tmp_path / "stand_in.py"
    script.write_text(f"ROOT = {str(Path(__file__).resolve().parent.parent)!r}\n" + STAND_IN)
    # "recorded": nothing is measured at the start; the test starts the (stand-in) selection itself
    async with serving(repo, variant_selection="recorded") as gw:
        plane = gw.server.plane
        assert _state(gw)["state"] == "off" and plane.get("encoder").spec.variant == "fp32"
        before = gw.pool("encoder")
        before.per_batch_s = 0.02  # calls queued behind a running batch at every moment, the swap's too
        stop, errors = asyncio.Event(), []
        load = [asyncio.create_task(_load(gw, stop, errors)) for _ in range(8)]
        await asyncio.sleep(0.2)
        selector = plane.selector
        selector.mode, selector.command = "auto", (sys.executable, str(script))
        selector.states["encoder"].state = "pending"
        selector.start()
        end = time.monotonic() + 60
        while _state(gw)["state"] not in ("switched", "failed") and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # calls on the new runtime too
        stop.set()
        answered = sum(await asyncio.gather(*load))
        sel = _state(gw)
        after = gw.pool("encoder")
        assert sel["state"] == "switched", sel
        assert plane.get("encoder").spec.variant == "optimized" and sel["variant"] == "optimized"
        assert sel["choice"]["variant"] == "optimized" and sel["host_class"] == host_class()
        assert sel["progress"].startswith("stand-in: step") and sel["seconds"] > 0
        assert errors == [], errors[:3]
        assert after is not before and before.batches and after.batches  # served on both sides
        # every call's 2 rows computed once, however the runtime cut the call into requests
        assert 2 * answered == before.rows_computed + after.rows_computed
        async with gw.http.get("/v2/models/encoder") as resp:
            meta = await resp.json()
        assert meta["batchgate"]["variant"] == "optimized"
        assert meta["batchgate"]["selection"]["state"] == "switched"
        assert await gw.metric("batchgate_variant_selection", model="encoder", state="switched") == 1


@pytest.mark.serial  # a real optimize --auto run in the child: seconds of one core
async def test_a_real_selection_runs_beside_the_original_and_the_next_start_loads_its_choice(tmp_path):
    pytest.importorskip("openvino")
    repo = _repo(tmp_path)
    model_dir = repo / "encoder"
    _prepare_optimized(model_dir)
    # a choice made on another CPU class is not this host's: it serves the original and measures
    write_entry(
        model_dir,
        "1",
        _entry(model_dir, "optimized", "GenuineIntel-6-143-amx_bf16"),
        "GenuineIntel-6-143-amx_bf16",
    )
    settings = {"variant_selection": "auto", "variant_selection_candidates": "openvino-fp32",
                "variant_selection_repeats": 1}  # fmt: skip
    async with serving(repo, **settings) as gw:
        assert gw.server.plane.get("encoder").spec.variant == "fp32"  # the original, at once
        stop, errors = asyncio.Event(), []
        load = asyncio.create_task(_load(gw, stop, errors, pause_s=0.02))
        end = time.monotonic() + 300
        while _state(gw)["state"] in ("pending", "selecting") and time.monotonic() < end:
            await asyncio.sleep(0.1)
        stop.set()
        await load
        sel = _state(gw)
        assert sel["state"] in ("switched", "kept"), sel
        assert errors == [], errors[:3]
        chosen = sel["choice"]["variant"]
        assert chosen in ("fp32", "openvino-fp32") and sel["variant"] == chosen
        assert "openvino-fp32" in sel["choice"]["candidates"]
        assert (model_dir / sel["choice"]["report"]).is_file()
    record = read_record(model_dir)["classes"]
    assert record["GenuineIntel-6-143-amx_bf16"]["1"]["variant"] == "optimized"  # the other class's kept
    assert record[host_class()]["1"]["variant"] == chosen
    async with serving(repo, **settings) as gw:  # the next start: loaded directly, nothing measured
        sel = _state(gw)
        assert sel["state"] == "recorded" and sel["variant"] == chosen, sel
        assert gw.server.plane.selector._task is None


@pytest.mark.parametrize(
    ("setting", "extra", "state"),
    [
        ("off", "", "off"),  # the server's setting
        ("auto", 'parameters { key: "variant_selection" value { string_value: "off" } }\n', "off"),
        ("auto", 'parameters { key: "variant" value { string_value: "fp32" } }\n', "pinned"),
    ],
)
async def test_off_or_pinned_keeps_the_original_though_a_choice_is_recorded(tmp_path, setting, extra, state):
    repo = _repo(tmp_path, extra)
    model_dir = repo / "encoder"
    _prepare_optimized(model_dir)
    write_entry(model_dir, "1", _entry(model_dir, "optimized", host_class()))
    async with serving(repo, variant_selection=setting) as gw:
        sel = _state(gw)
        assert sel["state"] == state and sel["variant"] == "fp32", sel
        assert gw.server.plane.get("encoder").spec.variant == "fp32"
        assert gw.server.plane.selector._task is None  # nothing measured
    async with serving(repo, variant_selection="auto") as gw:  # without the setting: the choice serves
        if not extra:
            sel = _state(gw)
            assert sel["state"] == "recorded" and sel["variant"] == "optimized", sel
            assert gw.server.plane.selector._task is None
    assert (model_dir / RECORD_FILE).is_file()


def test_select_command_reads_a_recorded_choice_and_skips_a_pinned_model(tmp_path):
    import subprocess

    repo = _repo(tmp_path)
    model_dir = repo / "encoder"
    _prepare_optimized(model_dir)
    write_entry(model_dir, "1", _entry(model_dir, "optimized", host_class()))
    pinned = repo / "pinned"
    shutil.copytree(model_dir, pinned)
    config = pinned / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "encoder"', 'name: "pinned"')
                      + 'parameters { key: "variant" value { string_value: "fp32" } }\n')  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "batchgate", "select", "--model-repository", str(repo)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"encoder: optimized for {host_class()} (prepared by the test" in out.stdout  # nothing measured
    assert "pinned: not selected: its config pins the engine" in out.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
async def test_a_read_only_model_directory_is_not_selected_in_the_background(tmp_path):
    repo = _repo(tmp_path)
    model_dir = repo / "encoder"
    model_dir.chmod(0o555)
    try:
        async with serving(repo, variant_selection="auto") as gw:
            sel = _state(gw)
            assert sel["state"] == "off" and "read-only" in sel["error"], sel
            assert gw.server.plane.selector._task is None
    finally:
        model_dir.chmod(0o755)


def test_remove_builds_takes_only_what_this_hosts_ended_processes_left(tmp_path):
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(ended.stdout)  # a process of this host that has ended
    model = tmp_path / "model.onnx"
    host = socket.gethostname()
    mine = build_path(variant_path(model, "int8"))  # this process's own, still building
    assert mine.name == f".model.int8.onnx.{host}.{os.getpid()}.build"
    left = tmp_path / f".model.int8.onnx.{host}.{dead}.build"
    other_host = tmp_path / f".model.int8.onnx.{host}x.{dead}.build"  # a replica elsewhere: not ours to judge
    for f in (mine, left, other_host):
        f.write_bytes(b"half")
    assert remove_builds(tmp_path) == [left]
    assert mine.exists() and other_host.exists()
    assert remove_builds(tmp_path, os.getpid()) == [mine]  # a stopped child's, by its pid
    assert other_host.exists()


# Not serial: nothing here is timed (a real child builds a candidate beside other tests).
@pytest.mark.parametrize("stop_s", [5.0, 0.0], ids=["ends-on-sigterm", "killed"])
async def test_a_server_stopping_mid_selection_leaves_no_half_written_build(tmp_path, monkeypatch, stop_s):
    """Each server stopped while its selection was building used to leave the candidate's file
    behind (``.model.int8.onnx.PID.build``, the model's size each): the child was killed."""
    from batchgate.gateway.selection import Selector

    monkeypatch.setattr(Selector, "STOP_S", stop_s)
    repo = _repo(tmp_path)
    version = repo / "encoder" / "1"
    settings = {
        "variant_selection": "auto",
        "variant_selection_candidates": "int8",
        "variant_selection_repeats": 3,
    }
    async with serving(repo, **settings) as gw:
        end = time.monotonic() + 120
        while not list(version.glob(".*.build")):
            assert _state(gw)["state"] in ("pending", "selecting"), _state(gw)
            assert time.monotonic() < end, "no build started"
            await asyncio.sleep(0.02)
        child = gw.server.plane.selector._proc
    assert child.returncode is not None  # ended, not left running
    # 143: it unwound on SIGTERM (its own clean-up ran); -9: killed, inside a native call past
    # STOP_S on a busy machine, and the server removed its build. Never -15 (no clean-up at all).
    assert (
        child.returncode == -signal.SIGKILL if stop_s == 0.0 else child.returncode in (143, -signal.SIGKILL)
    )
    assert not list(version.glob(".*.build")), sorted(p.name for p in version.iterdir())


def test_a_killed_servers_selection_removes_its_build_and_the_next_sweeps_the_rest(tmp_path):
    """The server SIGKILLed (an OOM kill, a node drained hard): its child notices and ends with its
    build removed; a build some earlier kill left is removed by the next selection, which says so."""
    repo = _repo(tmp_path)
    version = repo / "encoder" / "1"
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = version / f".model.openvino-fp32.onnx.{socket.gethostname()}.{int(ended.stdout)}.build"
    env = {"BATCHGATE_VARIANT_SELECTION": "auto", "BATCHGATE_VARIANT_SELECTION_CANDIDATES": "int8",
           "BATCHGATE_VARIANT_SELECTION_REPEATS": "3", "BATCHGATE_LOG_LEVEL": "INFO"}  # fmt: skip
    stale.write_bytes(b"half")
    server = start_server(tmp_path, repo=repo, env=env)
    try:
        end = time.monotonic() + 120
        while not _child_builds(version, stale):  # the child is building (it swept first)
            assert time.monotonic() < end, server.log()
            time.sleep(0.02)
        assert not stale.exists()
        assert "removed 1 half-written build(s) of stopped selections" in server.log()
    finally:
        server.proc.kill()
        server.proc.wait()
    end = time.monotonic() + 10
    while _child_builds(version, stale) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _child_builds(version, stale), sorted(p.name for p in version.iterdir())


def _child_builds(version: Path, stale: Path) -> list[Path]:
    return [p for p in version.glob(".*.build") if p != stale]
