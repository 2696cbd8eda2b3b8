"""Run a server with its asyncio event loop's turns and callbacks counted (lab/profile.py's
``--loop-turns``): how many times the loop wakes and how many callbacks it runs per call.

    python -m lab.loopcount OUT.json -m MODULE [ARGS...]

runs ``python -m MODULE ARGS`` with ``BaseEventLoop._run_once`` (one loop turn: a select, then
the callbacks that are ready) and ``Handle._run`` (one callback: a task step, a future's done
callback, a call_soon_threadsafe from a worker) wrapped in counters. On SIGUSR1 the counts so far
are written to OUT.json. The wrappers cost about a microsecond per callback, so CPU figures taken
under them are not the profile's; the counts are what this is for.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from asyncio import base_events, events

COUNTS = {"turns": 0, "callbacks": 0, "events": 0, "signals": 0}


def _install() -> None:
    run_once = base_events.BaseEventLoop._run_once
    handle_run = events.Handle._run

    def counted_run_once(self):
        COUNTS["turns"] += 1
        return run_once(self)

    def counted_handle_run(self):
        COUNTS["callbacks"] += 1
        return handle_run(self)

    base_events.BaseEventLoop._run_once = counted_run_once
    events.Handle._run = counted_handle_run


def _dump(path: str) -> None:
    COUNTS["signals"] += 1
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(COUNTS, f)
    os.replace(tmp, path)  # the reader never sees half a file


def wrap(cmd: list[str], out: str) -> list[str]:
    """``cmd`` (a server's command line, ``python [flags] -m MODULE ...``) run under this counter,
    writing to ``out``. The counter runs as a file, not ``-m lab.loopcount``: servers start with
    ``python -P`` (bench/loadgen.py ``PYTHON``), which keeps the checkout's root, and with it
    ``lab``, off sys.path."""
    at = cmd.index("-m")
    return [*cmd[:at], __file__, out, *cmd[at:]]


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    _install()
    signal.signal(signal.SIGUSR1, lambda *_: _dump(out))
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
