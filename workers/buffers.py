"""Memory pools: the input and output buffers of every bucket, allocated once and bound once.

For each set of bucket lengths a worker holds one buffer per input and per output, sized for the
most rows a run at those lengths may take. Each batch bucket is a *slot*: the first ``rows`` rows
of those buffers (a contiguous prefix, so no copy and no extra memory per batch bucket) bound to
the session once with IOBinding. A batch is copied into the slot's input views, the session runs
on the bound memory, and outputs are read from the slot's output views; nothing is allocated per
call except the per-request result arrays the caller keeps (the buffers are reused, so results
must be copied out).

A slot binds only the outputs it is made for (a model's on-request outputs are bound in slots of
their own, made when a batch first asks for them); an output's buffer is allocated the first time
a slot binds it, so one nobody asks for costs no memory.

CPU: plain numpy arrays, bound as OrtValues that share their memory.
GPU: pinned host arrays (the copy-in/copy-out side) and device arrays from a CuPy memory pool
(the bound side); a run is host->device copy, run, device->host copy, on one CUDA stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnxruntime as ort


class Slot:
    """One bound run configuration: a (rows, lengths) bucket on one session."""

    __slots__ = (
        "bucket", "rows", "seqs", "session", "binding", "run_options", "inputs", "outputs", "_run", "runs",
    )  # fmt: skip

    def __init__(
        self, bucket, rows, seqs, session, binding, run_options, inputs, outputs, run: Callable[[], None]
    ) -> None:
        self.bucket: tuple[int, ...] = bucket
        self.rows: int = rows
        self.seqs: tuple[int, ...] = seqs
        self.session: ort.InferenceSession = session
        self.binding = binding
        self.run_options = run_options
        self.inputs: dict[str, np.ndarray] = inputs  # host views the batch is copied into
        self.outputs: dict[str, np.ndarray] = outputs  # host views results are read from
        self._run = run
        self.runs = 0

    def run(self) -> None:
        self._run()
        self.runs += 1


class HostBuffers:
    """numpy buffers for one set of lengths (CPU engines)."""

    def __init__(self, input_shapes: dict[str, tuple[tuple[int, ...], np.dtype]],
                 output_shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:  # fmt: skip
        self.inputs = {n: np.zeros(shape, dtype) for n, (shape, dtype) in input_shapes.items()}
        self._output_shapes = output_shapes
        self.outputs: dict[str, np.ndarray] = {}  # allocated when a slot first binds them

    def _outputs(self, names: Sequence[str] | None) -> dict[str, np.ndarray]:
        for n in self._output_shapes if names is None else names:
            if n not in self.outputs:
                shape, dtype = self._output_shapes[n]
                self.outputs[n] = np.zeros(shape, dtype)
        return self.outputs if names is None else {n: self.outputs[n] for n in names}

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for a in self.inputs.values()) + sum(a.nbytes for a in self.outputs.values())

    device_bytes = 0

    def slot(
        self, bucket, rows: int, seqs, session: ort.InferenceSession, run_options=None,
        output_names: Sequence[str] | None = None,
    ) -> Slot:  # fmt: skip
        """``output_names``: the outputs this slot binds (None: all)."""
        inputs = {n: a[:rows] for n, a in self.inputs.items()}
        outputs = {n: a[:rows] for n, a in self._outputs(output_names).items()}
        if hasattr(session, "bind"):  # OpenVINO (workers/openvino_engine.py): tensors share the views
            return Slot(bucket, rows, seqs, session, None, run_options, inputs, outputs,
                        session.bind(inputs, outputs))  # fmt: skip
        binding = session.io_binding()
        # The OrtValues share the views' memory (no copy): what is written into ``inputs`` is
        # what the session reads, and the session writes its outputs straight into ``outputs``.
        values = []
        for n, a in inputs.items():
            v = ort.OrtValue.ortvalue_from_numpy(a)
            binding.bind_ortvalue_input(n, v)
            values.append(v)
        for n, a in outputs.items():
            v = ort.OrtValue.ortvalue_from_numpy(a)
            binding.bind_ortvalue_output(n, v)
            values.append(v)
        run_with = session.run_with_iobinding

        def run(binding=binding, values=values, run_options=run_options) -> None:  # values: keep alive
            run_with(binding, run_options)

        return Slot(bucket, rows, seqs, session, binding, run_options, inputs, outputs, run)


class CudaBuffers:
    """Pinned host + CuPy device buffers for one set of lengths (GPU engines).

    ``pool`` is the engine's own ``cupy.cuda.MemoryPool``, so its ``used_bytes()`` is exactly
    what the engine's buffers hold on the device.
    """

    def __init__(self, input_shapes, output_shapes, device_id: int, pool, stream) -> None:
        import cupy
        import cupyx

        self.device_id = device_id
        self.stream = stream

        def device_array(shape, dtype):
            dtype = np.dtype(dtype)
            mem = pool.malloc(max(int(np.prod(shape)) * dtype.itemsize, 1))
            return cupy.ndarray(shape, dtype, memptr=mem)

        def pinned(shape, dtype):
            a = cupyx.empty_pinned(shape, dtype)
            a.fill(0)
            return a

        self.host_in = {n: pinned(s, d) for n, (s, d) in input_shapes.items()}
        self.dev_in = {n: device_array(s, d) for n, (s, d) in input_shapes.items()}
        self._output_shapes = output_shapes
        self._pinned, self._device_array = pinned, device_array
        self.host_out: dict = {}  # allocated when a slot first binds them
        self.dev_out: dict = {}

    def _outputs(self, names: Sequence[str] | None) -> list[str]:
        names = list(self._output_shapes) if names is None else list(names)
        for n in names:
            if n not in self.host_out:
                shape, dtype = self._output_shapes[n]
                self.host_out[n] = self._pinned(shape, dtype)
                self.dev_out[n] = self._device_array(shape, dtype)
        return names

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for a in self.host_in.values()) + sum(a.nbytes for a in self.host_out.values())

    @property
    def device_bytes(self) -> int:
        return sum(a.nbytes for a in self.dev_in.values()) + sum(a.nbytes for a in self.dev_out.values())

    def slot(
        self, bucket, rows: int, seqs, session: ort.InferenceSession, run_options=None,
        output_names: Sequence[str] | None = None,
    ) -> Slot:  # fmt: skip
        """``output_names``: the outputs this slot binds (None: all)."""
        binding = session.io_binding()
        names = self._outputs(output_names)
        host_in = {n: a[:rows] for n, a in self.host_in.items()}
        host_out = {n: self.host_out[n][:rows] for n in names}
        # Views made once here, so a run creates no array objects on either side.
        dev_in = {n: a[:rows] for n, a in self.dev_in.items()}
        dev_out = {n: self.dev_out[n][:rows] for n in names}
        dev = self.device_id
        for n, a in dev_in.items():
            binding.bind_input(n, "cuda", dev, a.dtype.type, list(a.shape), a.data.ptr)
        for n, a in dev_out.items():
            binding.bind_output(n, "cuda", dev, a.dtype.type, list(a.shape), a.data.ptr)
        stream = self.stream
        run_with = session.run_with_iobinding
        to_device = [(dev_in[n], h) for n, h in host_in.items()]
        to_host = [(dev_out[n], h) for n, h in host_out.items()]

        def run() -> None:
            for d, h in to_device:
                d.set(h, stream=stream)
            # ORT computes on its own stream: the inputs must be on the device before it starts.
            # Run() synchronises its stream before returning, so the outputs are complete after it.
            stream.synchronize()
            run_with(binding, run_options)
            for d, h in to_host:
                d.get(stream=stream, out=h)
            stream.synchronize()

        return Slot(bucket, rows, seqs, session, binding, run_options, host_in, host_out, run)
