"""The host's best engine by default (DESIGN "Fast by default"; docs/engines.md, "Selected in the
background").

A model whose config sets no ``variant`` serves the variant recorded for this host's CPU class
(``variant_selection.json`` beside its config.pbtxt, keyed by ``workers.devices.host_class``:
vendor, family, model and the instruction sets that decide which variant wins). Where none is
recorded, the server serves the original at once and the ``Selector`` runs the same selection as
``batchgate optimize --auto`` in a child process (``python -m batchgate.gateway.selection``): niced
to the lowest priority, one engine thread, its address space bounded, one model at a time. Its
progress lines go to the server's log and the ``batchgate_variant_selection`` metric. When it
ends, the choice is recorded with the model and the data plane's reload path (dataplane.py: start
and warm beside, swap in one step, drain the old) switches to the winner without dropping a call.
The next start on the same class, or a replica sharing the repository, loads the winner directly;
a host of another class finds no entry for itself and measures for itself.

A record entry is served only while it still holds: the original's sha256 is the one measured,
and the chosen variant passes ``check_variant`` (its report passed and matches its file). Anything
else counts as no entry: served the original, measured again.

Off: the server's ``variant_selection=off`` (the tests' servers: tests/conftest.py, tests/harness.py)
or the model parameter ``variant_selection: off``; ``recorded`` serves recorded choices but never
measures. A ``variant`` in the config pins it (no record read, nothing measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import fcntl
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchgate.gateway.repository import (
    DEFAULT_MODEL_FILE,
    ConfigError,
    ModelSpec,
    check_variant,
    remove_builds,
    sha256_file,
)
from batchgate.workers.devices import host_class

__all__ = [
    "RECORD_FILE", "Selection", "Selector", "recorded", "recorded_variant", "select_repository", "write_entry",
]  # fmt: skip

log = logging.getLogger(__name__)

RECORD_FILE = "variant_selection.json"
LOCK_FILE = ".variant_selection.lock"
NICE = 19  # the child's niceness: the serving threads always go first
BUSY = 3  # the child's exit status when another process holds the model's selection lock
# Threads a library may start beside the engines' own single thread (NumPy's BLAS in INT8
# calibration, OpenMP): one each, so the selection takes at most about one core.
_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


# -- the record --------------------------------------------------------------------------------------


def read_record(model_dir: Path) -> dict:
    """The model's record: {"classes": {host class: {version: entry}}}; {} when none or unreadable."""
    try:
        data = json.loads((model_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded(model_dir: Path, version: str, model_file: Path, cls: str | None = None) -> dict | None:
    """This host class's entry for ``version``, while it still holds (the original is the one
    measured; a chosen variant still passes ``check_variant``); None otherwise."""
    cls = cls or host_class()
    entry = read_record(model_dir).get("classes", {}).get(cls, {}).get(str(version))
    if not isinstance(entry, dict):
        return None
    try:
        if entry.get("original_sha256") != sha256_file(model_file):
            log.info("model %s: the variant selected for %s was measured on another %s; selecting again",
                     model_dir.name, cls, model_file.name)  # fmt: skip
            return None
    except OSError:
        return None
    variant = entry.get("variant")
    if variant and variant != "fp32":
        try:
            check_variant(model_dir.name, str(version), model_file, variant)
        except ConfigError as exc:
            log.warning("model %s: the variant selected for %s no longer serves (%s); selecting again",
                        model_dir.name, cls, exc)  # fmt: skip
            return None
    return entry


def recorded_variant(model_dir: Path, version: str, model_file: Path) -> str | None:
    """The variant selected for this host class (``repository.load_model``'s ``choose``)."""
    entry = recorded(model_dir, version, model_file)
    return entry.get("variant") if entry is not None else None


@contextlib.contextmanager
def _locked(model_dir: Path, blocking: bool = True):
    """The model directory's selection lock (one selection per model across the replicas sharing
    the repository); yields False when ``blocking`` is off and another process holds it."""
    fd = os.open(model_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def write_entry(model_dir: Path, version: str, entry: dict, cls: str | None = None) -> None:
    """Record ``entry`` for this host class and ``version``, keeping every other class's."""
    cls = cls or host_class()
    path = model_dir / RECORD_FILE
    data = read_record(model_dir)
    data.setdefault("classes", {}).setdefault(cls, {})[str(version)] = entry
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# -- the child: one model's selection -------------------------------------------------------------------


def select(model_dir: Path, version: str, repeats: int, candidates: list[str] | None, say=print) -> dict:
    """Run ``optimize --auto`` on one model version and record its choice for this host class; the
    entry. A candidate that passes the gate and is no slower than the original at any batch size
    wins; none: the original (fp32) is recorded, so the next start does not measure again."""
    from batchgate.gateway.models.optimize import Options, optimize_auto

    t0 = time.perf_counter()
    cls = host_class()
    opts = Options("int8", version=version, memory=False, timing_repeats=repeats,
                   command="batchgate serve (variant_selection: auto, in the background)")  # fmt: skip
    res = optimize_auto(model_dir, opts, log=say, candidates=candidates)
    spec_file = res.report_file.with_name(res.report_file.name.replace(".auto.report.json", ".onnx"))
    report = res.report
    base = next(c for c in report["candidates"] if c["candidate"] == "fp32 (original)")
    chosen = res.chosen or "fp32"
    row = next((c for c in report["candidates"] if c["candidate"] == chosen), base)
    entry = {
        "variant": chosen,
        "status": "chosen",
        "why": "fastest that passed the gate" if res.chosen not in (None, "fp32")
        else "no candidate passed the gate" if res.chosen is None
        else "no candidate was faster than the original at every batch size",
        "x_original": row["x_original"],
        "candidates": {c["candidate"]: {"status": c["status"], "x_original": c["x_original"]}
                       for c in report["candidates"]},
        "skipped": report["skipped"],
        "report": str(res.report_file.with_suffix(".md").relative_to(model_dir)),
        "original_sha256": sha256_file(spec_file),
        "host_class": cls,
        "machine": report["machine"],
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    write_entry(model_dir, version, entry, cls)  # under the lock ``main`` holds
    return entry


def _bound(memory_mb: int) -> None:
    """Lowest priority, and at most ``memory_mb`` of address space (0: unbounded)."""
    with contextlib.suppress(OSError):
        os.nice(NICE - os.nice(0))
    if memory_mb:
        import resource

        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _exit_with_parent(builds: Path) -> None:
    """End this process when the server that started it ends (however it ends): a selection nobody
    will switch to is only load on the host. Its half-written builds in ``builds`` go with it."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        remove_builds(builds, os.getpid())
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m batchgate.gateway.selection",
                                 description="select the host's variant of one model (run by the server)")  # fmt: skip
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--version", required=True)
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (optimize --repeats)")
    ap.add_argument("--memory-mb", type=int, default=0, help="address-space bound (0: none)")
    ap.add_argument("--candidates", default="", help="comma-separated --auto candidates (default: all)")
    args = ap.parse_args(argv)
    builds = args.model_dir / args.version
    _exit_with_parent(builds)
    # SIGTERM (the server stopping, Selector.close) unwinds like an exception: the builds' own
    # clean-up runs (signal.SIG_DFL would end the process with their files left behind).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _bound(args.memory_mb)

    def say(line: str) -> None:
        print(line, flush=True)

    candidates = [c for c in args.candidates.split(",") if c] or None
    # The lock for the whole run: one selection of a model at a time across the replicas sharing
    # the repository; released by the kernel however this process ends.
    with _locked(args.model_dir, blocking=False) as mine:
        if not mine:
            say("another process is selecting this model's variant")
            return BUSY
        say(f"selecting on {host_class()} (nice {os.nice(0)}, pid {os.getpid()})")
        if builds.is_dir() and (left := remove_builds(builds)):  # of selections killed on this host
            say(
                f"removed {len(left)} half-written build(s) of stopped selections: {', '.join(f.name for f in left)}"
            )
        entry = select(args.model_dir, args.version, args.repeats, candidates, say)
    say(f"chosen: {entry['variant']} ({entry['why']}; x{entry['x_original']:.2f} the original) "
        f"in {entry['seconds']:.0f} s")  # fmt: skip
    return 0


def select_repository(
    root: Path, models: list[str], repeats: int = 3, candidates: str = "", memory_mb: int = 4096, say=print
) -> int:
    """``batchgate select``: each model (default: all) that a server would select for and that has
    no entry for this host class yet, selected one after another in this process (niced, bounded),
    waiting for another process selecting the same model (a replica sharing the repository) and
    then reading its choice. 0 when every model has a choice; 1 when one failed; 2 on bad input."""
    from batchgate.gateway.repository import load_model

    _bound(memory_mb)
    names = models or sorted(
        p.name for p in root.iterdir() if (p / "config.pbtxt").is_file() and p.name[0] not in "._"
    )
    failed = 0
    cls = host_class()
    for name in names:
        model_dir = root / name
        try:
            specs = load_model(model_dir, choose=None)
        except (ConfigError, FileNotFoundError) as exc:
            say(f"{name}: not selected: {exc}")
            failed += 1
            continue
        spec = specs[-1]
        given = spec.params.given
        if spec.params.variant_selection == "off" or "variant" in given or "engine" in given:
            say(f"{name}: not selected: its config pins the engine or turns variant_selection off")
            continue
        with _locked(model_dir) as _:  # waits while another process selects this model
            entry = recorded(model_dir, spec.version, spec.path, cls)
            if entry is None:
                try:
                    entry = select(model_dir, spec.version, repeats, [c for c in candidates.split(",") if c] or None,
                                   lambda line, n=name: say(f"{n}: {line}"))  # fmt: skip
                except Exception as exc:  # the next model is still selected
                    say(f"{name}: selection failed: {type(exc).__name__}: {exc}")
                    failed += 1
                    continue
        say(f"{name}: {entry['variant']} for {cls} ({entry.get('why')}; x{entry.get('x_original') or 1:.2f} the "
            f"original; {entry.get('date')})")  # fmt: skip
    return 1 if failed else 0


# -- the server side -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Selection:
    """One model's selection on this host, as the runtime (``ModelRuntime.selection``), the REST
    metadata, the log and the metric tell it. ``state``: ``off`` (the server's or the model's
    setting), ``pinned`` (the config names a variant), ``recorded`` (served as recorded for this
    class), ``pending``/``selecting`` (the original serves; measuring), ``switched`` (the winner
    now serves), ``kept`` (the original won), ``failed`` (the original keeps serving; ``error``
    says why), ``waiting`` (another replica holds the model's selection lock)."""

    model: str
    version: str
    host_class: str
    state: str
    variant: str  # what serves
    original: Path | None = None  # the original's file (model.onnx), measured against
    entry: dict | None = None  # the record's entry for this class (report, figures, when)
    progress: str = ""  # the selection's last progress line
    lines: int = 0
    started: float | None = None  # time.time() the selection started
    seconds: float | None = None  # its wall time, once done
    error: str = ""

    def as_dict(self) -> dict:
        out = {
            "state": self.state,
            "variant": self.variant,
            "host_class": self.host_class,
            "version": self.version,
        }
        if self.entry:
            out["choice"] = {k: self.entry[k] for k in ("variant", "why", "x_original", "report", "date",
                                                        "seconds", "machine", "candidates") if k in self.entry}  # fmt: skip
        if self.progress:
            out["progress"] = self.progress
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 1)
        if self.error:
            out["error"] = self.error
        return out


@dataclass(slots=True)
class Selector:
    """The server's background selections: which models need one (``note``, as each runtime
    starts), running them one at a time (``start``), switching through ``reload``."""

    root: Path
    mode: str  # the server's variant_selection: auto, recorded, off
    reload: object  # async (name) -> None: the data plane's reload
    memory_mb: int = 4096
    repeats: int = 3
    candidates: str = ""  # comma-separated --auto candidates; "" = all this host builds
    command: tuple[str, ...] = ()  # the child's program (); () = this module (tests put a stand-in here)
    states: dict[str, Selection] = field(default_factory=dict)
    _task: asyncio.Task | None = None
    _proc: asyncio.subprocess.Process | None = None
    _builds: Path | None = None  # the version folder the running child builds its variants in
    _cls: str = ""
    # Seconds a stopping server waits for the child to end on SIGTERM before killing it.
    STOP_S = 5.0

    def note(self, spec: ModelSpec, cpu: bool = True) -> Selection:
        """The selection of the model ``spec`` serves, as its runtime starts (a start, a reload);
        ``cpu``: its workers are all on the CPU (a GPU model is not selected for)."""
        cls = self._cls = self._cls or host_class()
        old = self.states.get(spec.name)
        given = spec.params.given
        entry, why = None, ""
        if self.mode == "off" or spec.params.variant_selection == "off" or not cpu:
            state = "off"
        elif "variant" in given or "engine" in given or spec.config.backend == "openvino":
            state = "pinned"  # the config chose the engine file: served as it says
        else:
            original = spec.path.parent / (spec.config.default_model_filename or DEFAULT_MODEL_FILE)
            entry = recorded(self.root / spec.name, spec.version, original, cls)
            if entry is not None:
                state = "recorded"
            elif self.mode == "auto" and not os.access(self.root / spec.name, os.W_OK):
                state = "off"  # nowhere to record a choice
                why = (
                    "the model directory is read-only: select before serving (`batchgate select`; the "
                    "chart's variantSelection.initContainer)"
                )
            elif (
                old is not None
                and old.version == spec.version
                and old.state in ("selecting", "waiting", "failed")
            ):
                state = old.state  # reloaded for another reason while (or after) selecting
            else:
                state = "pending" if self.mode == "auto" else "off"
        original = spec.path.parent / (spec.config.default_model_filename or DEFAULT_MODEL_FILE)
        sel = Selection(spec.name, spec.version, cls, state, spec.variant, original, entry)
        if old is not None and old.version == spec.version:
            sel.progress, sel.lines, sel.started, sel.seconds, sel.error = (
                old.progress,
                old.lines,
                old.started,
                old.seconds,
                old.error,
            )
        sel.error = why or sel.error
        self.states[spec.name] = sel
        self._log_start(sel)
        return sel

    @staticmethod
    def _log_start(sel: Selection) -> None:
        if sel.state == "recorded" and sel.entry:
            e = sel.entry
            log.info("model %s version %s: serves %s, selected for CPU class %s on %s (%s; x%.2f the original; "
                     "report %s)", sel.model, sel.version, sel.variant, sel.host_class, e.get("date"), e.get("why"),
                     e.get("x_original") or 1.0, e.get("report"),
                     extra={"event": "variant_selected", "model": sel.model})  # fmt: skip
        elif sel.state == "pending":
            log.info("model %s version %s: no variant selected for CPU class %s yet: serving %s now, selecting in "
                     "the background (variant_selection=off turns this off)", sel.model, sel.version,
                     sel.host_class, sel.variant, extra={"event": "variant_selection", "model": sel.model})  # fmt: skip

    def start(self) -> None:
        """Run the pending selections in the background, one model at a time."""
        if (
            self.mode == "auto"
            and self._task is None
            and any(s.state == "pending" for s in self.states.values())
        ):
            self._task = asyncio.get_running_loop().create_task(self._run_all(), name="variant-selection")

    async def _run_all(self) -> None:
        for name in list(self.states):
            sel = self.states.get(name)
            if sel is None or sel.state != "pending":
                continue
            try:
                await self._select(sel)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a selection never takes the server down
                sel.state, sel.error = "failed", f"{type(exc).__name__}: {exc}"
                log.exception("model %s: variant selection failed; it keeps serving %s", name, sel.variant)

    async def _select(self, sel: Selection) -> None:
        model_dir = self.root / sel.model
        sel.state, sel.started = "selecting", time.time()
        env = dict(os.environ, **dict.fromkeys(_ONE_THREAD, "1"))
        program = list(self.command) or [sys.executable, "-m", "batchgate.gateway.selection"]
        cmd = [*program, str(model_dir), "--version", sel.version,
               "--repeats", str(self.repeats), "--memory-mb", str(self.memory_mb)]  # fmt: skip
        if self.candidates:
            cmd += ["--candidates", self.candidates]
        t0 = time.perf_counter()
        self._builds = model_dir / sel.version
        proc = self._proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env
        )
        tail: list[str] = []
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            sel.progress, sel.lines = line[:300], sel.lines + 1
            tail = (tail + [line])[-5:]
            log.info("variant selection %s: %s", sel.model, line[:300],
                     extra={"event": "variant_selection_progress", "model": sel.model})  # fmt: skip
        rc = await proc.wait()
        self._proc = None
        sel.seconds = time.perf_counter() - t0
        if rc == BUSY:  # another replica measures this model: its record is read at the next start
            sel.state = "waiting"
            return
        entry = None
        if rc == 0:
            entry = await asyncio.to_thread(recorded, model_dir, sel.version, sel.original, sel.host_class)
        if entry is None:
            sel.state = "failed"
            sel.error = f"the selection exited {rc}: " + " | ".join(tail[-2:])
            log.error("model %s: variant selection failed after %.0f s; it keeps serving %s: %s",
                      sel.model, sel.seconds, sel.variant, sel.error)  # fmt: skip
            return
        sel.entry = entry
        if entry["variant"] == sel.variant:
            sel.state = "kept"
            log.info("model %s: variant selection done in %.0f s: %s keeps serving (%s)", sel.model,
                     sel.seconds, sel.variant, entry.get("why"), extra={"event": "variant_selected", "model": sel.model})  # fmt: skip
            return
        log.info("model %s: variant selection done in %.0f s: switching %s -> %s (x%.2f the original; report %s)",
                 sel.model, sel.seconds, sel.variant, entry["variant"], entry.get("x_original") or 1.0,
                 entry.get("report"), extra={"event": "variant_selected", "model": sel.model})  # fmt: skip
        try:
            await self.reload(sel.model)  # beside, swap, drain: no call dropped
        except Exception as exc:
            sel.state, sel.error = "failed", f"the switch failed: {exc}"
            log.error("model %s: switching to %s failed; it keeps serving %s: %s", sel.model, entry["variant"],
                      sel.variant, exc)  # fmt: skip
            return
        now = self.states.get(sel.model)
        if now is not None:  # ``note`` ran for the new runtime
            now.state = "switched" if now.variant == entry["variant"] else "failed"
            now.seconds, now.progress, now.started, now.lines = (
                sel.seconds,
                sel.progress,
                sel.started,
                sel.lines,
            )

    async def close(self) -> None:
        """Stop a selection under way (nothing recorded) and the task: the child is asked to end
        (SIGTERM: its builds remove their files), killed after STOP_S, and whatever build it
        left is removed here."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), self.STOP_S)
            except asyncio.TimeoutError:  # inside a long native call (a quantiser's pass)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            if self._builds is not None and self._builds.is_dir():
                await asyncio.to_thread(remove_builds, self._builds, proc.pid)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    def metric(self) -> list[tuple[str, str, str, float]]:
        """(model, host class, state, seconds so far or taken) per model, for /metrics."""
        out = []
        for s in self.states.values():
            secs = s.seconds if s.seconds is not None else (time.time() - s.started if s.started else 0.0)
            out.append((s.model, s.host_class, s.state, secs))
        return out


if __name__ == "__main__":
    sys.exit(main())
