"""One ONNX Runtime session and the work of running one batch on it.

A worker thread owns its engine; nothing here is shared between threads. The batch is
concatenated, run and split back *in the worker thread*, so the gateway's event loop only
hands over references and never touches tensor data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from workers.devices import Device


@dataclass(frozen=True, slots=True)
class EngineOptions:
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    graph_optimization: bool = True


@dataclass(slots=True)
class BatchTiming:
    """Nanoseconds spent in each phase, as Triton's statistics report them."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


class Engine:
    def __init__(self, model_path: Path, device: Device, options: EngineOptions) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = options.intra_op_threads
        so.inter_op_num_threads = options.inter_op_threads
        so.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            if options.graph_optimization
            else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
        # Worker threads are the unit of parallelism; ORT's own spinning threads would fight them.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if device.kind == "gpu":
            providers = [("CUDAExecutionProvider", {"device_id": device.id}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        self.device = device
        self.session = ort.InferenceSession(str(model_path), sess_options=so, providers=providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run_batch(
        self, parts: list[dict[str, np.ndarray]], rows: list[int], batched: bool
    ) -> tuple[list[dict[str, np.ndarray]], BatchTiming]:
        """Run the requests ``parts`` as one batch and split the outputs back by ``rows``.

        With ``batched`` false (max_batch_size 0) there is exactly one part and no batch dim.
        """
        timing = BatchTiming()
        t0 = time.perf_counter_ns()
        if len(parts) == 1:
            feeds = parts[0]
        else:
            feeds = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        t1 = time.perf_counter_ns()
        outputs = self.session.run(self.output_names, feeds)
        t2 = time.perf_counter_ns()
        if not batched or len(parts) == 1:
            split = [dict(zip(self.output_names, outputs))]
        else:
            split = []
            start = 0
            for n in rows:
                split.append({name: out[start : start + n] for name, out in zip(self.output_names, outputs)})
                start += n
            total = start
            for name, out in zip(self.output_names, outputs):
                if out.shape[0] != total:
                    raise RuntimeError(
                        f"output '{name}' has {out.shape[0]} rows for a batch of {total}; "
                        "the model does not keep the batch dimension"
                    )
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.perf_counter_ns() - t2
        return split, timing
