"""What lets the suite run on several pytest-xdist workers (``make test`` passes ``-n``) without a
test seeing another's load or files.

- ``@pytest.mark.serial``: the test measures time, latency or throughput, or loads the machine to
  see what it does under load. It runs with no other test in flight: it waits until the tests
  running on the other workers have ended, and none starts until it has.
- ``@pytest.mark.holds("name")``: the test writes somewhere every worker shares (the checkout's
  ``build/`` folder, for one): no other test holding the same name runs at the same time.

Both are ``flock`` locks on files in one folder per run, made by the controller and named to every
worker (``pytest_configure_node``). Every other test holds the run lock shared, so a serial test is
a writer among readers; a turnstile lock that the waiting writer holds keeps new readers from
starting ahead of it, so it waits only for the tests already running. Without xdist there is
nothing to wait for and no lock is taken.

A serial test waits for every test in flight, so serial tests are run together, last
(``scheduling``): tests go to workers a file at a time (a module's fixtures, often a server, are
built once), and every serial test, whatever its file, joins one last unit, whose
tests keep the lock from one to the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

# The longest files, longest first (wall seconds on 5 workers, 2 cores, 2026-12-06), so that the
# last files to start are short and none runs alone before or after the serial unit (a file out
# of date here only costs some of that).
FIRST = ("test_openvino.py", "test_optimize.py", "test_minilm.py", "test_helm_platform.py", "test_openapi.py",
         "test_instruction_guard.py", "test_client.py", "test_cache_server.py", "test_drain.py",
         "test_gpu_check.py", "test_prepare_model.py", "test_lifecycle.py", "test_prepare_onnx.py",
         "test_gate.py", "test_helm.py", "test_embeddings_api.py", "test_token_budgets.py",
         "test_prepare_sources.py", "test_dashboard_picture.py", "test_prompts_dimensions.py",
         "test_front_door.py", "test_slow_bodies.py", "test_engines.py", "test_packaging.py",
         "test_perf_bench.py", "test_tls.py")  # fmt: skip
KEY = "batchgate_locks"  # the workerinput entry naming the run's lock folder
LAST = "batchgate_serial_last"  # the workerinput entry saying the scheduler below runs


def _flock(stack: contextlib.ExitStack, path: Path, mode: int) -> None:
    f = stack.enter_context(path.open("a"))
    fcntl.flock(f, mode)  # closing the file (the stack unwinding) releases it


class Turns:
    """One worker's side of the locks in ``folder`` (None: not an xdist worker, no locks)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.alone: contextlib.ExitStack | None = None  # held from one serial test to the next

    @contextlib.contextmanager
    def turn(self, item: pytest.Item, nextitem: pytest.Item | None):
        """Hold what ``item``'s markers ask for while it runs (setup, call and teardown)."""
        if self.folder is None:
            yield
            return
        with contextlib.ExitStack() as held:
            for mark in item.iter_markers("holds"):
                _flock(held, self.folder / f"holds-{mark.args[0]}", fcntl.LOCK_EX)
            if _serial(item):
                if self.alone is None:
                    self.alone = contextlib.ExitStack()
                    _flock(self.alone, self.folder / "turnstile", fcntl.LOCK_EX)  # no test starts now
                    _flock(self.alone, self.folder / "run", fcntl.LOCK_EX)  # those running end
                try:
                    yield
                finally:
                    if nextitem is None or not _serial(nextitem):
                        self.alone.close()
                        self.alone = None
                return
            with contextlib.ExitStack() as turnstile:  # waits while a serial test waits or runs
                _flock(turnstile, self.folder / "turnstile", fcntl.LOCK_EX)
            _flock(held, self.folder / "run", fcntl.LOCK_SH)
            yield


def _serial(item: pytest.Item) -> bool:
    return item.get_closest_marker("serial") is not None


def arrange(items: list[pytest.Item], folder: Path) -> None:
    """On a worker: the longest files first, the serial tests last, and those named to the
    scheduler (every worker writes the same list; the controller reads it once all collected)."""
    serial = [item for item in items if _serial(item)]
    rest = [item for item in items if not _serial(item)]
    rest.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))
    items[:] = rest + serial
    tmp = folder / f"serial.{os.getpid()}"
    tmp.write_text("".join(f"{item.nodeid}\n" for item in serial))
    tmp.replace(folder / "serial")


def ours(config: pytest.Config) -> bool:
    """Whether ``scheduling`` runs this xdist session: for -n alone and for --dist loadfile."""
    return config.getvalue("dist") in ("load", "loadfile")


def scheduling(config: pytest.Config, log, folder: Path):
    """A file per unit, in collection order, and the serial tests as one last unit."""
    from xdist.scheduler import LoadFileScheduling  # only where xdist runs

    class Scheduling(LoadFileScheduling):
        serial: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.serial is None:  # first called once every worker has collected
                self.serial = set((folder / "serial").read_text().splitlines())
            return "serial" if nodeid in self.serial else super()._split_scope(nodeid)

    config.option.loadscopereorder = False  # by size would put the serial unit anywhere
    return Scheduling(config, log)
