"""batchgate_device_memory_bytes{device,pool}: what the workers' pools report, summed over models
per device (the driver's figure, a whole-device one, taken once), and on a live server."""

from __future__ import annotations

from types import SimpleNamespace

from batchgate.gateway.metrics import _worker_families
from tests.test_metrics import scrape

NAME = "batchgate_device_memory_bytes"


def _snap(model: str, memory) -> SimpleNamespace:
    return SimpleNamespace(
        model=model, version="1", workers=(("w0", 0.0),), memory=tuple(memory), tokenized=None
    )


def test_pools_add_up_over_models_and_the_driver_figure_is_taken_once():
    a = _snap(
        "encoder",
        [("gpu:0", "io_buffers", 100), ("gpu:0", "pinned_host", 10), ("gpu:0", "driver_used", 5000)],
    )
    b = _snap(
        "minilm", [("gpu:0", "io_buffers", 50), ("gpu:0", "driver_used", 5000), ("cpu:0", "io_buffers", 7)]
    )
    (fam,) = [f for f in _worker_families([a, b]) if f.name == NAME]
    got = {(s.labels["device"], s.labels["pool"]): s.value for s in fam.samples}
    assert got == {
        ("gpu:0", "io_buffers"): 150,
        ("gpu:0", "pinned_host"): 10,
        ("gpu:0", "driver_used"): 5000,
        ("cpu:0", "io_buffers"): 7,
    }


def test_a_live_cpu_server_reports_its_buffers(server):
    samples = scrape(server)
    mine = {labels: v for (name, labels), v in samples.items() if name == NAME}
    assert mine, f"{NAME} missing from /metrics"
    # The bundled models run pooled engines on the CPU: their buffers are host memory on cpu:0.
    assert mine[(("device", "cpu:0"), ("pool", "io_buffers"))] > 0
    assert all(dict(k)["device"] == "cpu:0" for k in mine), mine
