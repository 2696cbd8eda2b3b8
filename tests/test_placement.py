"""Where a model runs (docs/engines.md, "Where a model runs"): the rule with fake device lists, the
chart's GPU values through it, and a real server started with ``--device gpu`` on a machine
without a GPU (this one), where the documented behaviour is all there is to see."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

from batchgate.gateway.config import Settings
from batchgate.gateway.repository import load_repository
from batchgate.gateway.runtime import place_model, usable_cores, workers_per_device
from batchgate.workers import Device, EngineOptions, NoGPU, WorkerPool, gpu_count, place
from tests.conftest import REPO, start_server
from tests.string_models import write_string_add_sub
from tests.test_helm import _cached

CPU = (Device("cpu"),)


def gpus(*ids: int) -> tuple[Device, ...]:
    return tuple(Device("gpu", i) for i in ids)


@pytest.mark.parametrize(
    "kind, device, visible, want, note",
    [
        # device=auto: the config decides
        ("cpu", "auto", 2, CPU, ""),
        ("gpu", "auto", 2, gpus(0, 1), ""),
        ("auto", "auto", 2, gpus(0, 1), ""),
        ("auto", "auto", 0, CPU, ""),
        # device=cpu: the CPU for everything, and a GPU config says it was overridden
        ("gpu", "cpu", 2, CPU, "device=cpu"),
        ("cpu", "cpu", 2, CPU, ""),
        # device=gpu: overrides KIND_CPU (the bundled models' kind) on every visible GPU
        ("cpu", "gpu", 1, gpus(0), "device=gpu overrides KIND_CPU"),
        ("cpu", "gpu", 4, gpus(0, 1, 2, 3), "device=gpu overrides KIND_CPU"),
        ("gpu", "gpu", 2, gpus(0, 1), ""),
        ("auto", "gpu", 1, gpus(0), ""),
    ],
)
def test_rule(kind, device, visible, want, note):
    p = place(kind, device, visible=visible)
    assert (p.devices, p.note, p.fallback) == (want, note, "")


def test_instance_group_gpus_are_kept_and_checked():
    assert place("gpu", "auto", visible=4, gpus=(2, 3)).devices == gpus(2, 3)
    with pytest.raises(ValueError, match=r"GPU\(s\) \[3\] but only 2 are visible"):
        place("gpu", "gpu", visible=2, gpus=(1, 3))


@pytest.mark.parametrize("kind, device", [("cpu", "gpu"), ("gpu", "auto"), ("gpu", "gpu")])
def test_a_gpu_asked_for_where_none_is_fails_or_falls_back_as_the_config_says(kind, device):
    asker = "device=gpu" if device == "gpu" else "instance_group KIND_GPU"
    with pytest.raises(
        NoGPU, match=rf"{asker} asks for a GPU but none is usable \(fake: no driver\).*'fail'"
    ):
        place(kind, device, visible=0, why_none="fake: no driver")  # the default: fail
    p = place(kind, device, visible=0, fallback="cpu", why_none="fake: no driver")
    assert p.devices == CPU
    assert p.note == f"{asker}: no usable GPU, gpu_fallback=cpu"
    assert "(fake: no driver)" in p.fallback and "serving on the CPU" in p.fallback


@pytest.mark.parametrize("visible", [0, 1])
def test_string_models_stay_on_the_cpu_provider_and_say_so(visible):
    p = place("cpu", "gpu", visible=visible, strings=True)
    assert p.devices == CPU and "string tensors: CPU provider" in p.note
    assert place("cpu", "auto", visible=visible, strings=True) == place("cpu", "auto", visible=visible)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="gpu_fallback must be one of"):
        place("gpu", visible=1, fallback="maybe")
    with pytest.raises(ValueError, match="'tpu'"):
        place("cpu", "tpu", visible=0)


# -- the chart's GPU values through the rule -------------------------------------------------------


def _chart_settings(name: str, monkeypatch) -> Settings:
    """Settings exactly as a pod of the chart rendered with value set ``name`` would read them."""
    for k in [k for k in __import__("os").environ if k.startswith("BATCHGATE_")]:
        monkeypatch.delenv(k)
    for k, v in _cached(name).config.items():
        monkeypatch.setenv(k, v)
    return Settings()


@pytest.mark.parametrize("values, count", [("gpu", 2), ("everything", 1)])
def test_chart_gpu_values_put_every_bundled_model_on_the_pods_gpus(values, count, monkeypatch):
    s = _chart_settings(values, monkeypatch)
    assert s.device == "gpu"
    repo = load_repository(REPO)
    assert repo.models, "no bundled models"
    for name, versions in repo.models.items():
        for spec in versions.values():
            # The device plugin shows the pod exactly gpu.count devices.
            p = place_model(spec, s, probe=lambda: (count, ""))
            assert p.devices == gpus(*range(count)), name
            assert p.note == "device=gpu overrides KIND_CPU", name
            n = workers_per_device(spec, s)
            assert n == (s.workers_per_device or 2), name  # the bundled configs say count: 2
            pool = WorkerPool(name, spec.path, list(p.devices), n, EngineOptions())  # not started
            on = [str(w.device) for w in pool.workers]
            assert on == [str(d) for d in p.devices for _ in range(n)], f"{name}: N workers on each GPU"
            # Without a GPU on the node the load fails, saying why and what would change it.
            with pytest.raises(NoGPU, match="device=gpu asks for a GPU but none is usable.*gpu_fallback"):
                place_model(spec, s, probe=lambda: (0, "fake: no device"))


def test_chart_without_gpu_follows_the_config(monkeypatch):
    s = _chart_settings("defaults", monkeypatch)
    assert s.device == "auto"
    for versions in load_repository(REPO).models.values():
        for spec in versions.values():
            assert place_model(spec, s, probe=lambda: (8, "")).devices == CPU  # KIND_CPU, GPUs or not


def test_string_model_under_device_gpu(tmp_path):
    write_string_add_sub(tmp_path)
    (spec,) = load_repository(tmp_path).models["simple_string"].values()
    p = place_model(spec, Settings(device="gpu"), probe=lambda: (1, ""))
    assert p.devices == CPU and "string tensors: CPU provider" in p.note


# -- a real server with --device gpu where there is no GPU ---------------------------------------------


@pytest.mark.skipif(gpu_count() > 0, reason="shows the no-GPU behaviour; this machine has a GPU")
def test_device_gpu_without_a_gpu_fails_each_model_with_one_line(tmp_path):
    repo = tmp_path / "repo"
    for name in ("encoder", "ranker"):
        shutil.copytree(REPO / name, repo / name)
    srv = start_server(tmp_path, "--device", "gpu", repo=repo)
    try:
        log = srv.log()
    finally:
        srv.stop()
    for name in ("encoder", "ranker"):
        lines = [ln for ln in log.splitlines() if f"model {name} " in ln]
        assert len(lines) == 1, lines
        assert re.search(
            rf"ERROR .*model {name} version 1 failed to start: device=gpu asks for a GPU but none is "
            r"usable \(.+\); the model's gpu_fallback is 'fail'",
            lines[0],
        ), lines[0]


@pytest.mark.skipif(gpu_count() > 0, reason="shows the no-GPU behaviour; this machine has a GPU")
def test_device_gpu_without_a_gpu_falls_back_when_the_config_says_cpu(tmp_path):
    import tritonclient.grpc as tc

    repo = tmp_path / "repo"
    shutil.copytree(REPO / "encoder", repo / "encoder")
    cfg = repo / "encoder" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + '\nparameters { key: "gpu_fallback" value { string_value: "cpu" } }\n')
    srv = start_server(tmp_path, "--device", "gpu", repo=repo)
    try:
        with tc.InferenceServerClient(srv.grpc_url) as client:
            ids = np.arange(8, dtype=np.int64).reshape(1, 8)
            ins = []
            for n, a in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
                ins.append(tc.InferInput(n, list(a.shape), "INT64"))
                ins[-1].set_data_from_numpy(a)
            assert client.infer("encoder", ins).as_numpy("embedding").shape[0] == 1
        log = srv.log()
    finally:
        srv.stop()
    warnings = [ln for ln in log.splitlines() if " WARNING " in ln and "gpu_fallback" in ln]
    assert len(warnings) == 1, warnings
    assert "model encoder version 1: device=gpu asks for a GPU but none is usable" in warnings[0]
    (loaded,) = [ln for ln in log.splitlines() if "loaded model encoder" in ln]
    assert "worker(s) on cpu:0 (device=gpu: no usable GPU, gpu_fallback=cpu)" in loaded, loaded


def test_a_gpu_session_that_lands_on_the_cpu_fails_loudly(tmp_path, monkeypatch):
    """onnxruntime-gpu whose CUDA provider cannot load (libraries missing) puts sessions on the CPU
    with only a warning; a GPU worker must fail instead of serving on the CPU unnoticed. Here the
    CPU wheel stands in for it, told to list the CUDA provider as built in."""
    import onnxruntime as ort

    from batchgate.workers import sessions

    encoder = REPO / "encoder" / "1" / "model.onnx"
    factory = sessions.SessionFactory(encoder, "", Device("gpu", 0), cache_dir=tmp_path)
    real = ort.get_available_providers()
    monkeypatch.setattr(sessions.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    with pytest.raises(
        RuntimeError, match=r"gpu:0: onnxruntime put the session on \['CPUExecutionProvider'\]"
    ):
        factory.create()
    # The CPU wheel as it is (no CUDA provider to lose) and CPU workers are left alone.
    monkeypatch.setattr(sessions.ort, "get_available_providers", lambda: real)
    assert factory.create().get_providers() == ["CPUExecutionProvider"]
    cpu = sessions.SessionFactory(encoder, "", Device("cpu"))
    monkeypatch.setattr(sessions.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    assert cpu.create().get_providers() == ["CPUExecutionProvider"]


def test_cpu_workers_are_capped_at_the_cores_the_process_may_use():
    """The bundled configs ask for 2 workers; pinned to one core (as taskset or a cpuset pins a
    server) the CPU gets one, a GPU keeps its count, and the server's own setting is never capped."""
    spec = next(iter(load_repository(REPO).models["minilm"].values()))
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(mine)})
        assert workers_per_device(spec, Settings(), CPU) == 1
        assert workers_per_device(spec, Settings(), gpus(0)) == 2
        assert workers_per_device(spec, Settings(workers_per_device=3), CPU) == 3
    finally:
        os.sched_setaffinity(0, mine)
    assert workers_per_device(spec, Settings(), CPU) == min(2, len(mine))
    assert workers_per_device(spec, Settings(intra_op_threads=len(mine)), CPU) == 1


@pytest.mark.parametrize(
    "cpu_max, most",
    [("100000 100000", 1), ("150000 100000", 2), ("max 100000", None), ("garbage", None), (None, None)],
)
def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path, cpu_max, most):
    """A Kubernetes CPU limit is a cgroup v2 quota (cpu.max: quota and period, or "max"): the pod's
    affinity mask still shows every node core, so the quota is read too, rounded up."""
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    mask = len(os.sched_getaffinity(0))
    assert usable_cores(path) == (mask if most is None else min(mask, most))


def test_a_cgroup_cpu_quota_caps_the_cpu_workers(tmp_path, monkeypatch):
    """The quota reaches the worker count, not only usable_cores: a pod limited to one core gets one
    CPU worker though its mask shows every core (the real usable_cores, reading this file)."""
    from functools import partial

    from batchgate.gateway import runtime

    spec = next(iter(load_repository(REPO).models["minilm"].values()))  # its config asks for 2
    one_core = tmp_path / "cpu.max"
    one_core.write_text("100000 100000\n")
    monkeypatch.setattr(runtime, "usable_cores", partial(usable_cores, one_core))
    assert workers_per_device(spec, Settings(), CPU) == 1
    assert workers_per_device(spec, Settings(), gpus(0)) == 2  # a GPU's workers are not the CPU's
    one_core.write_text("max 100000\n")
    assert workers_per_device(spec, Settings(), CPU) == min(2, len(os.sched_getaffinity(0)))
