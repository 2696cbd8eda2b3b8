"""ONNX Runtime sessions for the engines: options, providers, and the on-disk cache of optimised models.

Graph optimisation (fusions, constant folding; for a static engine also folding the shape
arithmetic its fixed dims make constant) runs when a session is created. Its result is saved
once per (model fingerprint, ORT version, provider, hardware, fixed dims) and later sessions load
the saved graph with optimisation off: measured on the bundled encoder, 6-7 ms instead of 18-25 ms
per session, which adds up over a worker's buckets. The cache is an optimisation only: a cache
dir that cannot be written, or a saved file that fails to load, means a plain session.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import tempfile
import threading
from pathlib import Path

import onnxruntime as ort

from batchgate.workers.devices import Device, cpu_flags
from batchgate.workers.fingerprint import external_files, file_fingerprint

log = logging.getLogger(__name__)

CACHE_SUBDIR = "engines"

_env_arena_lock = threading.Lock()
_env_arena = False


def default_cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/batchgate/engines`` (or ``~/.cache/...``) when writable, else the temp dir;
    None when neither can be written (a read-only root with no writable temp)."""
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    candidates = [Path(base) / "batchgate" / CACHE_SUBDIR]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    candidates.append(Path(tempfile.gettempdir()) / f"batchgate-{uid}" / CACHE_SUBDIR)
    for c in candidates:
        if usable_dir(c):
            return c
    return None


def usable_dir(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _hardware_tag() -> str:
    """What a CPU-optimised graph may depend on: the machine and its instruction-set flags."""
    return f"{platform.machine()}:{hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]}"


_HARDWARE = _hardware_tag()


def providers(device: Device, cuda_graphs: bool = False) -> list:
    if device.kind == "gpu":
        opts = {
            "device_id": device.id,
            # Each engine's arena grows by what it asks for, not to the next power of two: with
            # fixed shapes the asks repeat exactly, so nothing is held that is never used.
            "arena_extend_strategy": "kSameAsRequested",
        }
        if cuda_graphs:
            opts["enable_cuda_graph"] = "1"
        return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _use_shared_cpu_arena(so: ort.SessionOptions) -> None:
    """One CPU arena for every session that opts in, process-wide.

    Each session otherwise keeps its own arena at the peak its largest run needed; with one
    session per bucket that is the sum over buckets (measured on the encoder, 42 buckets:
    2.5 GB resident per worker, against 0.9 GB sharing one arena).
    """
    global _env_arena
    with _env_arena_lock:
        if not _env_arena:
            info = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
            _env_arena = True
    so.add_session_config_entry("session.use_env_allocators", "1")


# Graph fusions CPU sessions skip: ONNX Runtime's CPU SkipLayerNormalization (residual Add +
# LayerNormalization fused, as in an INT8 variant's graph) runs slower than the two ops it
# replaces at every width and thread count measured (docs/engines.md, "Optimisation: variants").
CPU_DISABLED_FUSIONS = ("SkipLayerNormFusion",)


def disabled_fusions(device_kind: str) -> list[str]:
    """The graph fusions a session on ``device_kind`` ("cpu" or "gpu") is created without."""
    return list(CPU_DISABLED_FUSIONS) if device_kind == "cpu" else []


class SessionFactory:
    """Creates one worker's sessions; caches optimised graphs under ``cache_dir`` when given."""

    def __init__(
        self,
        model_path: Path,
        fingerprint: str,
        device: Device,
        *,
        intra_op_threads: int = 1,
        inter_op_threads: int = 1,
        graph_optimization: bool = True,
        cache_dir: Path | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.model_path = Path(model_path)
        self.fingerprint = fingerprint or file_fingerprint(self.model_path)
        self.device = device
        self.intra_op_threads = intra_op_threads
        self.inter_op_threads = inter_op_threads
        self.graph_optimization = graph_optimization
        self.cache_dir = cache_dir if cache_dir is not None and usable_dir(cache_dir) else None
        if cache_dir is not None and self.cache_dir is None:
            log.warning("engine cache dir %s is not writable; optimised models are not cached", cache_dir)
        if self.cache_dir is not None and external_files(self.model_path):
            # ORT saves an optimised graph as one protobuf: a model past 2 GiB cannot be saved,
            # and a smaller one would copy its weights into the cache (per shape, in static
            # mode). Optimising at load costs what docs/embeddings.md measures instead.
            log.info(
                "%s keeps its weights in external data; optimised models are not cached", self.model_path
            )
            self.cache_dir = None
        self.cuda_graphs = cuda_graphs
        self.hits = 0
        self.misses = 0

    def _options(self, overrides: dict[str, int] | None, shared_arena: bool) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.intra_op_threads
        so.inter_op_num_threads = self.inter_op_threads
        # Worker threads are the unit of parallelism; ORT's own spinning threads would fight them.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        for name, value in (overrides or {}).items():
            so.add_free_dimension_override_by_name(name, int(value))
        if shared_arena and self.device.kind == "cpu":
            _use_shared_cpu_arena(so)
        return so

    def cache_path(self, overrides: dict[str, int] | None, cuda_graphs: bool) -> Path | None:
        if self.cache_dir is None or not self.graph_optimization:
            return None
        provider = "cuda" if self.device.kind == "gpu" else "cpu"
        hw = _HARDWARE
        if provider == "cuda":
            hw += f":gpu{self.device.id}:{_gpu_name(self.device.id)}"
        dims = ",".join(f"{k}={v}" for k, v in sorted((overrides or {}).items()))
        skipped = ",".join(disabled_fusions(self.device.kind))
        ident = f"{self.fingerprint}|ort {ort.__version__}|{provider}|{hw}|{dims}|graphs={int(cuda_graphs)}|no={skipped}"
        digest = hashlib.sha256(ident.encode()).hexdigest()[:20]
        model = self.model_path.parent.parent.name or "model"
        return self.cache_dir / f"{model}-{self.fingerprint[:12]}-{digest}.onnx"

    def create(
        self,
        overrides: dict[str, int] | None = None,
        *,
        shared_arena: bool = False,
        cuda_graphs: bool | None = None,
    ) -> ort.InferenceSession:
        """A session with ``overrides`` fixing symbolic dims (None: dims stay dynamic)."""
        graphs = self.cuda_graphs if cuda_graphs is None else cuda_graphs
        provs = providers(self.device, graphs)
        cached = self.cache_path(overrides, graphs)
        if cached is not None and cached.is_file():
            so = self._options(overrides, shared_arena)
            # Already optimised for exactly this provider, hardware and shapes: skip the passes.
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            try:
                sess = ort.InferenceSession(str(cached), sess_options=so, providers=provs)
            except Exception as exc:  # a truncated or foreign file: rebuild it
                log.warning("cached engine %s failed to load (%s); rebuilding it", cached, exc)
            else:
                self.hits += 1
                return on_its_device(sess, self.device)
        so = self._options(overrides, shared_arena)
        level = ort.GraphOptimizationLevel
        so.graph_optimization_level = (
            level.ORT_ENABLE_ALL if self.graph_optimization else level.ORT_DISABLE_ALL
        )
        tmp = None
        if cached is not None:
            # Written beside the final name, then renamed: another worker or process loading the
            # same engine never sees half a file.
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            so.optimized_model_filepath = str(tmp)
            # The saved graph may hold hardware-specific layouts; the cache key names the hardware,
            # so ORT's warning about that says nothing new.
            so.log_severity_level = 3
        try:
            sess = ort.InferenceSession(
                str(self.model_path),
                sess_options=so,
                providers=provs,
                disabled_optimizers=disabled_fusions(self.device.kind),
            )
        except Exception:
            if tmp is None:
                raise
            log.warning("saving the optimised model to %s failed; no cache for it", tmp, exc_info=True)
            _unlink(tmp)
            so = self._options(overrides, shared_arena)
            sess = ort.InferenceSession(
                str(self.model_path),
                sess_options=so,
                providers=provs,
                disabled_optimizers=disabled_fusions(self.device.kind),
            )
            return on_its_device(sess, self.device)
        self.misses += 1
        if tmp is not None:
            try:
                os.replace(tmp, cached)
            except OSError as exc:
                log.warning("could not store cached engine %s: %s", cached, exc)
                _unlink(tmp)
        return on_its_device(sess, self.device)


def on_its_device(sess: ort.InferenceSession, device: Device) -> ort.InferenceSession:
    """``sess``, or RuntimeError when a GPU worker's session ended up on the CPU provider: ORT does
    that with only a warning when its CUDA provider is built in but cannot load (CUDA or cuDNN
    libraries missing or of another version), and a GPU pod would then serve on its CPU unnoticed.
    (With the CPU wheel there is no CUDA provider to lose; placement never puts a model on a GPU.)"""
    if device.kind == "gpu" and "CUDAExecutionProvider" in ort.get_available_providers():
        got = sess.get_providers()
        if not got or got[0] != "CUDAExecutionProvider":
            raise RuntimeError(
                f"{device}: onnxruntime put the session on {got}, not the CUDA provider: it could not "
                "load it (ONNX Runtime's log above says why; CUDA 13 and cuDNN 9 libraries are needed)"
            )
    return sess


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _gpu_name(device_id: int) -> str:
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        name = props.get("name", b"")
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return "unknown"
