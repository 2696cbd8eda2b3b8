"""A stand-in for CuPy and for the CUDA side of ONNX Runtime's IOBinding, on a machine without a GPU.

It stands in only for what this machine lacks (CuPy, CUDA memory, streams); ONNX Runtime's CPU
sessions and numpy stay real. It is strict where the real thing would be wrong silently:

* device memory belongs to the device that was current when its pool allocated it (CUDA's current
  device is per thread); a binding must say ``"cuda"`` and that device's id, or it raises, as
  ORT on a GPU would read the wrong memory or none;
* copies on a stream are *queued* and land only when that stream is synchronised, as a CUDA
  stream's do: a run started before the synchronise reads the previous batch's inputs;
* every copy, synchronise and run is recorded in order (``events``), so a test can hold a run to
  host->device copies, synchronise, run, device->host copies, synchronise;
* each session created records the CUDA device its provider options name (``session_devices``):
  ORT runs a session without ``device_id`` on GPU 0, whatever device its bound buffers are on.

Bound 'device' memory is handed to ORT as CPU memory (it is numpy memory here), so the CPU session
runs on exactly the bytes the engine's device buffers hold. Used by tests/test_engines.py and by
``bench/gpu_check.py --dry-run-cpu``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator

import numpy as np


class BindingError(AssertionError):
    """A device buffer bound with the wrong device type or id."""


class FakeCuda:
    def __init__(self, devices: int = 2) -> None:
        fake = self
        self.devices = devices
        # ("h2d", stream) / ("sync", stream) / ("run", binding) / ("d2h", stream), in call order.
        self.events: list[tuple] = []
        # (input|output, name, device type, device id, the device the memory is on), one per bind.
        self.binds: list[tuple[str, str, str, int, int]] = []
        # Per session created: the device_id of its CUDA provider (ORT's default 0 when unnamed),
        # None for a session without the CUDA provider.
        self.session_devices: list[int | None] = []
        self._allocs: list[tuple[int, int, int, np.ndarray]] = []  # (start, end, device, the memory)
        self._lock = threading.Lock()
        self._current = threading.local()

        class MemoryPointer:
            def __init__(self, buf: np.ndarray, device_id: int) -> None:
                self.buf, self.device_id, self.ptr = buf, device_id, buf.ctypes.data

        class MemoryPool:
            def __init__(self) -> None:
                self.used = 0

            def malloc(self, n: int) -> MemoryPointer:
                dev = fake.current_device()
                buf = np.zeros(n, np.uint8)
                with fake._lock:
                    fake._allocs.append((buf.ctypes.data, buf.ctypes.data + n, dev, buf))
                self.used += n
                return MemoryPointer(buf, dev)

            def used_bytes(self) -> int:
                return self.used

            def free_all_blocks(self) -> None:
                pass

        class Device:
            def __init__(self, i: int | None = None) -> None:
                self.id = fake.current_device() if i is None else i
                if not 0 <= self.id < fake.devices:
                    raise RuntimeError(f"cudaErrorInvalidDevice: device {self.id} of {fake.devices}")
                self._prev: list[int] = []

            def use(self) -> None:
                fake._current.device = self.id

            def __enter__(self):
                self._prev.append(fake.current_device())
                self.use()
                return self

            def __exit__(self, *exc) -> None:
                fake._current.device = self._prev.pop()

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                self.pending: list = []

            def synchronize(self) -> None:
                fake.events.append(("sync", self))
                for op in self.pending:
                    op()
                self.pending.clear()

        def enqueue(stream, op) -> None:
            if stream is None:  # the legacy default stream: done before the call returns
                op()
            else:
                stream.pending.append(op)

        class ndarray:  # noqa: N801 - CuPy's name
            def __init__(self, shape, dtype=None, memptr=None, _a=None, _dev=None) -> None:
                if _a is None:
                    _a = np.frombuffer(memptr.buf, dtype=dtype, count=int(np.prod(shape))).reshape(shape)
                    _dev = memptr.device_id
                self._a = _a
                self.device = Device(_dev)
                self.dtype, self.shape, self.nbytes = _a.dtype, _a.shape, _a.nbytes
                self.data = types.SimpleNamespace(ptr=_a.ctypes.data)

            def __getitem__(self, key):
                return ndarray(None, _a=self._a[key], _dev=self.device.id)

            def set(self, arr: np.ndarray, stream=None) -> None:
                assert arr.shape == self.shape and arr.dtype == self.dtype and arr.flags.c_contiguous
                fake.events.append(("h2d", stream))
                enqueue(stream, lambda: np.copyto(self._a, arr))

            def get(self, stream=None, out=None):
                assert out.shape == self.shape and out.dtype == self.dtype
                fake.events.append(("d2h", stream))
                enqueue(stream, lambda: np.copyto(out, self._a))
                return out

        self.ndarray = ndarray
        self.__version__ = "fake"
        runtime = types.SimpleNamespace(
            memGetInfo=lambda: (6 << 30, 8 << 30),
            getDeviceCount=lambda: fake.devices,
            getDeviceProperties=lambda i: {"name": b"Fake GPU"},
        )
        self.cuda = types.SimpleNamespace(
            Device=Device, MemoryPool=MemoryPool, Stream=Stream, runtime=runtime
        )
        self.cupyx = types.SimpleNamespace(empty_pinned=lambda shape, dtype: np.empty(shape, dtype))
        self._default_pool = MemoryPool()

    def get_default_memory_pool(self):
        return self._default_pool

    def current_device(self) -> int:
        return getattr(self._current, "device", 0)

    def device_of(self, ptr: int) -> int:
        """The device whose memory holds ``ptr``; raises for memory no fake pool gave out."""
        with self._lock:
            for start, end, dev, _ in self._allocs:
                if start <= ptr < end:
                    return dev
        raise BindingError(f"pointer {ptr:#x} is not device memory from a CuPy pool")

    def _check_bind(self, kind: str, name: str, device_type: str, device_id: int, ptr: int) -> None:
        on = self.device_of(ptr)
        self.binds.append((kind, name, device_type, device_id, on))
        if device_type != "cuda" or device_id != on:
            raise BindingError(
                f"{kind} '{name}' bound as ({device_type!r}, {device_id}); its memory is on ('cuda', {on})"
            )

    def _record_session(self, providers) -> None:
        cuda = [
            p for p in providers or () if (p[0] if isinstance(p, tuple) else p) == "CUDAExecutionProvider"
        ]
        opts = cuda[0][1] if cuda and isinstance(cuda[0], tuple) else {}
        self.session_devices.append(int(opts.get("device_id", 0)) if cuda else None)

    @staticmethod
    def run_events(stream, n_inputs: int, n_outputs: int) -> list[tuple]:
        """What one slot run must record, in this order (binding shown as None)."""
        return [
            *[("h2d", stream)] * n_inputs,
            ("sync", stream),  # inputs on the device before ORT, on its own stream, reads them
            ("run", None),
            *[("d2h", stream)] * n_outputs,
            ("sync", stream),  # outputs in host memory before the caller reads them
        ]

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeCuda]:
        """``import cupy`` / ``cupyx`` give the fake, and IOBinding's device binds and runs go
        through its checks; all undone on exit."""
        from onnxruntime.capi import onnxruntime_inference_collection as oic

        fake = self
        bind_input, bind_output = oic.IOBinding.bind_input, oic.IOBinding.bind_output
        run_with = oic.InferenceSession.run_with_iobinding
        create = oic.InferenceSession._create_inference_session

        def fake_bind_input(binding, name, device_type, device_id, element_type, shape, buffer_ptr):
            fake._check_bind("input", name, device_type, device_id, buffer_ptr)
            bind_input(binding, name, "cpu", 0, element_type, shape, buffer_ptr)

        def fake_bind_output(binding, name, device_type="cpu", device_id=0, element_type=None, shape=None,
                             buffer_ptr=None):  # fmt: skip
            if buffer_ptr is None:  # ORT allocates the output itself: no device memory of ours
                return bind_output(binding, name, device_type, device_id, element_type, shape, buffer_ptr)
            fake._check_bind("output", name, device_type, device_id, buffer_ptr)
            bind_output(binding, name, "cpu", 0, element_type, shape, buffer_ptr)

        def fake_run(session, iobinding, run_options=None):
            fake.events.append(("run", iobinding))
            return run_with(session, iobinding, run_options)

        def fake_create(session, providers, provider_options, disabled_optimizers=None):
            # read before ORT's CPU wheel drops the CUDA provider it lacks (with a warning)
            fake._record_session(providers)
            return create(session, providers, provider_options, disabled_optimizers)

        patches = [(oic.IOBinding, "bind_input", fake_bind_input),
                   (oic.IOBinding, "bind_output", fake_bind_output),
                   (oic.InferenceSession, "run_with_iobinding", fake_run),
                   (oic.InferenceSession, "_create_inference_session", fake_create)]  # fmt: skip
        saved_attrs = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
        saved_mods = {m: sys.modules.get(m) for m in ("cupy", "cupyx")}
        try:
            for obj, name, value in patches:
                setattr(obj, name, value)
            sys.modules["cupy"], sys.modules["cupyx"] = self, self.cupyx  # type: ignore[assignment]
            yield self
        finally:
            for obj, name, value in saved_attrs:
                if value is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, value)
            for m, mod in saved_mods.items():
                if mod is None:
                    sys.modules.pop(m, None)
                else:
                    sys.modules[m] = mod

    def runs_in_order(self, stream, n_inputs: int, n_outputs: int) -> int:
        """Number of runs recorded, after checking that each followed ``run_events`` exactly on
        ``stream``; raises AssertionError at the first run that did not."""
        want = self.run_events(stream, n_inputs, n_outputs)
        got = [(op, None if op == "run" else s) for op, s in self.events]
        k = len(want)
        assert got, "no copies, synchronisations or runs recorded"
        for i in range(0, max(len(got), 1), k):
            chunk = got[i : i + k]
            assert chunk == want, f"run {i // k}: events {_names(chunk, stream)}, want {_names(want, stream)}"
        return len(got) // k


def _names(events, stream) -> list[str]:
    where = {id(stream): "engine stream", id(None): "default stream"}
    return [op if op == "run" else f"{op} on {where.get(id(s), 'another stream')}" for op, s in events]
