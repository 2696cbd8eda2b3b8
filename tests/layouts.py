"""Model folders in transformers' own layout, written with numpy: the tests that serve or prepare
a model of a family run without torch, and only those that compare with transformers load it.

A layout (``tests/data/layouts/NAME.json``) is what ``save_pretrained`` wrote for one tiny model:
its config.json and the name, shape and dtype of every tensor in model.safetensors. It is recorded
by transformers itself (``python -m tests.layouts``, with the ``reference`` extra, rewrites every
layout from the ``LAYOUTS`` builders of the modules in ``MODULES``), never by hand; the reference
tests load each folder into transformers and assert that every weight was read and none left over
(``tests/tiny_models.py``'s ``TransformersModel``), so a layout that no longer matches transformers
fails there.

``write_folder`` fills a layout with scrambled weights drawn by numpy (normal around 0, std 0.3, far
from transformers' init; every norm's scale around 1).
``save_torch_file`` writes a ``torch.save`` state dict (BGE-M3's head files) without torch.
"""

from __future__ import annotations

import importlib
import io
import json
import pickle
import struct
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

LAYOUTS = Path(__file__).parent / "data" / "layouts"
SCRAMBLE_STD = 0.3
# The test modules whose LAYOUTS (name -> a function returning an untrained transformers model)
# are recorded here.
MODULES = ("tests.test_prepare_families", "tests.test_prepare_rerankers", "tests.test_prepare_bge_m3",
           "tests.test_prepare_colbert", "tests.test_prepare_onnx", "tests.test_prepare_decoders")  # fmt: skip
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def layout(name: str) -> dict:
    return json.loads((LAYOUTS / f"{name}.json").read_text())


def is_norm_scale(name: str) -> bool:
    """A norm's scale (BERT's ``LayerNorm.weight``, DistilBERT's ``sa_layer_norm.weight``,
    ModernBERT's ``attn_norm.weight``, the RMS norms of decoders), drawn around 1 not 0."""
    return "norm" in name.lower() and name.endswith("weight")


def scrambled(shapes: dict, seed: int, std: float = SCRAMBLE_STD) -> dict[str, np.ndarray]:
    """Random float32 tensors for ``{name: shape}``: norms' scales around 1, the rest around 0."""
    rng = np.random.default_rng(seed)
    return {
        name: ((1.0 if is_norm_scale(name) else 0.0) + std * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in shapes.items()
    }


def write_folder(folder: Path, name: str, seed: int, std: float = SCRAMBLE_STD, **config) -> Path:
    """``folder`` as transformers saved layout ``name``, weights scrambled from ``seed``; ``config``
    fields override the recorded config.json's (e.g. ``id2label``). No tokenizer is written."""
    from safetensors.numpy import save_file

    lay = layout(name)
    floats = {n: t["shape"] for n, t in lay["tensors"].items() if "values" not in t}
    tensors = scrambled(floats, seed, std)
    for n, t in lay["tensors"].items():
        if "values" in t:  # a saved buffer (position ids): its values, not noise
            tensors[n] = np.asarray(t["values"], dtype=_DTYPES[t["dtype"]]).reshape(t["shape"])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**lay["config"], **config}, indent=2))
    return folder


# -- torch.save without torch ------------------------------------------------------------------------


class _Global:
    """A name the pickle refers to (``torch._utils._rebuild_tensor_v2``) without importing it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args):  # save_reduce asks for a callable; it is never called
        raise TypeError(f"{self.module}.{self.name} is only a name here")


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table can take _Global
    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file, storages: list) -> None:
        super().__init__(file, protocol=2)
        self.storages = storages

    def _save_global(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = _save_global

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", _Global("torch", "FloatStorage"), obj.key, "cpu", obj.numel)
        return None


class _Storage:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride = tuple(int(np.prod(self.shape[i + 1 :])) for i in range(len(self.shape)))
        empty = _Reduce(_Global("collections", "OrderedDict"), ())
        return (
            _Global("torch._utils", "_rebuild_tensor_v2"),
            (self.storage, 0, self.shape, stride, False, empty),
        )


class _Reduce:
    def __init__(self, func: _Global, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


class _StateDict:
    """``collections.OrderedDict`` of the tensors, pickled as torch pickles a state dict."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __reduce__(self):
        return (_Global("collections", "OrderedDict"), (), None, None, iter(self.items))


def save_torch_file(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """``path`` as ``torch.save(state_dict)`` writes it (a zip: ``data.pkl``, one little-endian
    file per storage, ``version``, ``byteorder``), float32 tensors only."""
    storages, items, raw = [], [], {}
    for i, (name, array) in enumerate(tensors.items()):
        a = np.ascontiguousarray(array, dtype="<f4")
        storage = _Storage(str(i), a.size)
        storages.append(storage)
        items.append((name, _Tensor(storage, tuple(int(s) for s in a.shape))))
        raw[str(i)] = a.tobytes()
    buf = io.BytesIO()
    _Pickler(buf, storages).dump(_StateDict(items))
    root = Path(path).stem
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{root}/data.pkl", buf.getvalue())
        z.writestr(f"{root}/byteorder", "little")
        for key, data in raw.items():
            z.writestr(f"{root}/data/{key}", data)
        z.writestr(f"{root}/version", "3\n")
    return Path(path)


# -- recording (needs transformers) ------------------------------------------------------------------


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def record(name: str, model) -> Path:
    """Write layout ``name`` from what ``model.save_pretrained`` writes."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text())
        header = _header(Path(tmp) / "model.safetensors")
        tensors = {}
        for n, t in sorted(header.items()):
            if n == "__metadata__":
                continue
            entry = {"shape": t["shape"], "dtype": t["dtype"]}
            if not t["dtype"].startswith(("F", "BF")):  # an integer buffer: keep its values
                from safetensors.numpy import load_file

                entry["values"] = load_file(str(Path(tmp) / "model.safetensors"))[n].ravel().tolist()
            tensors[n] = entry
    config.pop("transformers_version", None)
    LAYOUTS.mkdir(parents=True, exist_ok=True)
    out = LAYOUTS / f"{name}.json"
    out.write_text(json.dumps({"config": config, "tensors": tensors}, indent=1) + "\n")
    return out


def main(argv: list[str]) -> None:
    wanted = set(argv)
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for name, build in getattr(module, "LAYOUTS", {}).items():
            if not wanted or name in wanted:
                print("recorded", record(name, build()))


if __name__ == "__main__":
    main(sys.argv[1:])
