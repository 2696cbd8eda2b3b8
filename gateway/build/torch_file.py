"""A ``torch.save`` state dict (``*.pt``: a zip holding ``data.pkl`` and one raw file per storage)
read into numpy arrays without PyTorch, as BGE-M3 ships its ``colbert_linear.pt`` and
``sparse_linear.pt``.

The pickle is unpickled by an allow-list: only the names a plain tensor state dict uses
(``torch._utils._rebuild_tensor_v2``, the typed storages, ``collections.OrderedDict``) resolve;
anything else (code a crafted file would run) is refused by name, as ``torch.load(weights_only=True)``
refuses it.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np

# Storage class -> element type (ml_dtypes registers bfloat16 with numpy).
_STORAGES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
             "DoubleStorage": "float64"}  # fmt: skip


class TorchFileError(ValueError):
    """The file is not a state dict of float tensors this reader knows; the message says why."""


class _StorageType:
    def __init__(self, name: str) -> None:
        import ml_dtypes  # noqa: F401  (numpy learns "bfloat16")

        self.name, self.dtype = name, np.dtype(_STORAGES[name])


def _rebuild_tensor_v2(storage, offset, size, stride, *_rest):
    items = storage[offset:]
    view = np.lib.stride_tricks.as_strided(
        items, shape=tuple(size), strides=tuple(s * items.itemsize for s in stride), writeable=False
    )
    return view.astype(np.float32)


def read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """{name: float32 array} from a ``torch.save``'d state dict."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise TorchFileError(
            f"{path} is not a torch.save zip archive (the legacy format before torch 1.6 is not read)"
        )
    with zipfile.ZipFile(path) as z:
        pkl = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
        if pkl is None:
            raise TorchFileError(f"{path} holds no data.pkl")
        root = pkl[: -len("data.pkl")]

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str):
                if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                    return _rebuild_tensor_v2
                if module == "torch" and name in _STORAGES:
                    return _StorageType(name)
                if (module, name) == ("collections", "OrderedDict"):
                    return collections.OrderedDict
                raise TorchFileError(f"{path}: {module}.{name} is not part of a plain tensor state dict")

            def persistent_load(self, pid):
                kind, storage, key, _location, numel = pid
                if kind != "storage" or not isinstance(storage, _StorageType):
                    raise TorchFileError(f"{path}: storage {pid!r} is not a float storage")
                data = np.frombuffer(z.read(f"{root}data/{key}"), dtype=storage.dtype)
                if data.size != numel:
                    raise TorchFileError(f"{path}: storage {key} holds {data.size} values, not {numel}")
                return data

        try:
            state = Unpickler(io.BytesIO(z.read(pkl))).load()
        except TorchFileError:
            raise
        except Exception as exc:  # a truncated or foreign pickle
            raise TorchFileError(f"{path}: not a readable state dict ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise TorchFileError(f"{path} is not a state dict of tensors")
    return dict(state)
