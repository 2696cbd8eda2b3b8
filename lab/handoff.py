"""What one hand-off between a front process and an engine process costs on this machine.

The prototype behind docs/scaling.md: a front process puts a batch's input rows into a slot of a
``multiprocessing.shared_memory`` block and sends a 16-byte control message (slot, rows, sequence)
over an ``AF_UNIX`` ``SOCK_SEQPACKET`` socketpair; the engine process reads the rows out of the
slot, writes one FP32 score per row into the slot's output area (a no-op model: the cost measured
is the crossing, not a model) and answers with the same 16 bytes. Three ways of driving it:

* ``pingpong``: one hand-off at a time, blocking calls (the floor: two context switches);
* ``asyncio``: the front is an asyncio loop (as the gateway's is) with ``--inflight`` hand-offs
  outstanding, replies read by ``loop.add_reader``;
* ``thread``: today's in-process crossing for comparison, ``loop.run_in_executor`` to one worker
  thread with the same rows and the same number outstanding.

For each it prints wall µs per hand-off (a loaded machine: indicative) and the CPU µs per hand-off
of the front and of the engine (utime + stime from /proc: robust), at 1 and 64 rows.

    .venv/bin/python -m lab.handoff [--n 20000] [--rows 1,64] [--inflight 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import numpy as np

from batchgate.bench.loadgen import process_cpu, self_cpu

_MSG = struct.Struct("<IIQ")  # slot, rows, sequence number
_ROW_IN = 64 * 4 + 8 * 8  # the ranker's row: dense FP32[64] + sparse_ids INT64[8]
_ROW_OUT = 4  # one FP32 score


class Slots:
    """A shared-memory block cut into ``n`` slots of ``max_rows`` input rows + output scores."""

    def __init__(self, n: int, max_rows: int) -> None:
        self.n, self.max_rows = n, max_rows
        self.in_bytes, self.out_bytes = max_rows * _ROW_IN, max_rows * _ROW_OUT
        self.slot_bytes = self.in_bytes + self.out_bytes
        self.shm = shared_memory.SharedMemory(create=True, size=n * self.slot_bytes)

    def inputs(self, slot: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        base = slot * self.slot_bytes
        dense = np.ndarray((rows, 64), np.float32, self.shm.buf, base)
        ids = np.ndarray((rows, 8), np.int64, self.shm.buf, base + self.max_rows * 64 * 4)
        return dense, ids

    def outputs(self, slot: int, rows: int) -> np.ndarray:
        return np.ndarray((rows, 1), np.float32, self.shm.buf, slot * self.slot_bytes + self.in_bytes)

    def close(self, unlink: bool) -> None:
        self.shm.close()
        if unlink:
            self.shm.unlink()


def _engine(sock: socket.socket, slots: Slots) -> None:
    """The engine process: read a control message, read the slot's rows, write scores, answer."""
    buf = bytearray(_MSG.size)
    while True:
        n = sock.recv_into(buf)
        if n == 0:
            return
        slot, rows, seq = _MSG.unpack(buf)
        dense, _ = slots.inputs(slot, rows)  # (a model would read sparse_ids the same way)
        out = slots.outputs(slot, rows)
        # A stand-in for the model that reads every dense row once.
        np.sum(dense, axis=1, keepdims=True, out=out)
        sock.send(_MSG.pack(slot, rows, seq))


def _spawn_engine(slots: Slots) -> tuple[int, socket.socket]:
    front, back = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # the engine: only the socket and the mapped block cross the fork
        front.close()
        try:
            _engine(back, slots)
        finally:
            os._exit(0)
    back.close()
    return pid, front


def _request_rows(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rows)
    return rng.standard_normal((rows, 64), dtype=np.float32), rng.integers(
        0, 10_000, (rows, 8), dtype=np.int64
    )


def _check(out: np.ndarray, dense: np.ndarray) -> None:
    """The engine really read the rows the front wrote and its answer came back."""
    if not np.allclose(out, dense.sum(axis=1, keepdims=True), rtol=1e-4, atol=1e-4):
        raise AssertionError("the engine's scores do not match the rows handed to it")


def _result(name: str, rows: int, n: int, wall: float, front_cpu: float, engine_cpu: float) -> dict:
    return {
        "mode": name,
        "rows": rows,
        "handoffs": n,
        "wall_us_per_handoff_loaded_machine": wall / n * 1e6,
        "front_cpu_us_per_handoff": front_cpu / n * 1e6,
        "engine_cpu_us_per_handoff": engine_cpu / n * 1e6,
        "total_cpu_us_per_handoff": (front_cpu + engine_cpu) / n * 1e6,
        "total_cpu_us_per_row": (front_cpu + engine_cpu) / n / rows * 1e6,
    }


def pingpong(n: int, rows: int) -> dict:
    slots = Slots(1, rows)
    pid, sock = _spawn_engine(slots)
    dense, ids = _request_rows(rows)
    buf = bytearray(_MSG.size)
    try:
        for warm in (True, False):
            count = n // 10 if warm else n
            t0, f0, e0 = time.perf_counter(), self_cpu(), process_cpu(pid)
            for seq in range(count):
                d, i = slots.inputs(0, rows)
                d[...] = dense  # the front's copy: request bytes into the slot
                i[...] = ids
                sock.send(_MSG.pack(0, rows, seq))
                sock.recv_into(buf)
                slots.outputs(0, rows).tobytes()  # the front's copy out, into its answer
            t1, f1, e1 = time.perf_counter(), self_cpu(), process_cpu(pid)
        _check(slots.outputs(0, rows), dense)
        return _result("pingpong", rows, n, t1 - t0, f1 - f0, e1 - e0)
    finally:
        sock.close()
        os.waitpid(pid, 0)
        slots.close(unlink=True)


async def _asyncio_front(
    n: int, rows: int, inflight: int, pid: int, sock: socket.socket, slots: Slots
) -> dict:
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    dense, ids = _request_rows(rows)
    waiting: dict[int, asyncio.Future] = {}
    free = list(range(slots.n))
    buf = bytearray(_MSG.size)

    def readable() -> None:  # every reply that is there, in one loop turn
        while True:
            try:
                sock.recv_into(buf)
            except BlockingIOError:
                return
            _, _, seq = _MSG.unpack(buf)
            fut = waiting.pop(seq)
            fut.set_result(None)

    loop.add_reader(sock.fileno(), readable)
    seqs = iter(range(1 << 62))

    last: list[np.ndarray] = []

    async def one() -> None:
        slot = free.pop()
        d, i = slots.inputs(slot, rows)
        d[...] = dense
        i[...] = ids
        seq = next(seqs)
        fut = loop.create_future()
        waiting[seq] = fut
        sock.send(_MSG.pack(slot, rows, seq))
        await fut
        last[:] = [np.frombuffer(slots.outputs(slot, rows).tobytes(), np.float32).reshape(rows, 1)]
        free.append(slot)

    async def sender(count: int) -> None:
        for _ in range(count):
            await one()

    try:
        for warm in (True, False):
            count = n // 10 if warm else n
            t0, f0, e0 = time.perf_counter(), self_cpu(), process_cpu(pid)
            await asyncio.gather(*(sender(count // inflight) for _ in range(inflight)))
            t1, f1, e1 = time.perf_counter(), self_cpu(), process_cpu(pid)
        _check(last[0], dense)
        done = (n // inflight) * inflight
        return _result(f"asyncio x{inflight}", rows, done, t1 - t0, f1 - f0, e1 - e0)
    finally:
        loop.remove_reader(sock.fileno())


def asyncio_mode(n: int, rows: int, inflight: int) -> dict:
    slots = Slots(inflight, rows)
    pid, sock = _spawn_engine(slots)
    try:
        return asyncio.run(_asyncio_front(n, rows, inflight, pid, sock, slots))
    finally:
        sock.close()
        os.waitpid(pid, 0)
        slots.close(unlink=True)


def thread_mode(n: int, rows: int, inflight: int) -> dict:
    """Today's crossing: the loop hands a batch to a worker thread and awaits its future."""
    dense, ids = _request_rows(rows)
    out = np.empty((rows, 1), np.float32)
    staged_d, staged_i = np.empty_like(dense), np.empty_like(ids)

    def work() -> None:
        np.sum(staged_d, axis=1, keepdims=True, out=out)

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1)

        async def sender(count: int) -> None:
            for _ in range(count):
                staged_d[...] = dense
                staged_i[...] = ids
                await loop.run_in_executor(pool, work)
                out.tobytes()

        try:
            for warm in (True, False):
                count = n // 10 if warm else n
                t0, c0 = time.perf_counter(), self_cpu()
                await asyncio.gather(*(sender(count // inflight) for _ in range(inflight)))
                t1, c1 = time.perf_counter(), self_cpu()
            done = (n // inflight) * inflight
            return _result(f"thread x{inflight}", rows, done, t1 - t0, c1 - c0, 0.0)
        finally:
            pool.shutdown()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="hand-offs per measurement")
    ap.add_argument("--rows", default="1,64", help="rows per hand-off, comma-separated")
    ap.add_argument("--inflight", type=int, default=4, help="hand-offs outstanding (asyncio, thread)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        results.append(pingpong(args.n, rows))
        results.append(asyncio_mode(args.n, rows, args.inflight))
        results.append(thread_mode(args.n, rows, args.inflight))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'mode':<12} {'rows':>4} {'wall µs':>8} {'front CPU µs':>12} {'engine CPU µs':>13} "
          f"{'total CPU µs':>12} {'per row':>8}   (per hand-off; wall from a loaded machine)")  # fmt: skip
    for r in results:
        print(
            f"{r['mode']:<12} {r['rows']:>4} {r['wall_us_per_handoff_loaded_machine']:>8.1f} "
            f"{r['front_cpu_us_per_handoff']:>12.1f} {r['engine_cpu_us_per_handoff']:>13.1f} "
            f"{r['total_cpu_us_per_handoff']:>12.1f} {r['total_cpu_us_per_row']:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
