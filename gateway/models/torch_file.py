"""A ``torch.save`` state dict (``*.pt``: a zip holding ``data.pkl`` and one raw file per storage)
read into numpy arrays without PyTorch, as BGE-M3 ships its ``colbert_linear.pt`` and
``sparse_linear.pt``.

``data.pkl`` is never unpickled: its opcodes are read (``pickletools.genops``) by a small stack
machine that knows only what a plain tensor state dict holds (strings, ints, tuples, dicts, the
names ``torch._utils._rebuild_tensor_v2``, the float storages and ``collections.OrderedDict``, and
the persistent ids of the storages). A name or opcode outside that set is refused by name; nothing
in the file is ever called, so a crafted file runs no code.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

import numpy as np

# Storage class -> element type (ml_dtypes registers bfloat16 with numpy).
_STORAGES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
             "DoubleStorage": "float64"}  # fmt: skip
_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_ORDERED = ("collections", "OrderedDict")
_MARK = object()


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


def _global(path: Path, module: str, name: str):
    if (module, name) in (_REBUILD, _ORDERED):
        return (module, name)
    if module == "torch" and name in _STORAGES:
        return _StorageType(name)
    raise TorchFileError(f"{path}: {module}.{name} is not part of a plain tensor state dict")


def _interpret(path: Path, data: bytes, storage_of) -> object:
    """The value ``data`` (the opcodes of data.pkl) describes, built without running any of it."""
    stack: list = []
    memo: dict = {}

    def pop_mark() -> list:
        items = []
        while True:
            item = stack.pop()
            if item is _MARK:
                return items[::-1]
            items.append(item)

    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            return stack.pop()
        if name == "MARK":
            stack.append(_MARK)
        elif name in ("EMPTY_DICT",):
            stack.append({})
        elif name in ("EMPTY_TUPLE",):
            stack.append(())
        elif name in ("EMPTY_LIST",):
            stack.append([])
        elif name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "BININT", "BININT1",
                      "BININT2", "LONG1", "INT", "LONG", "BINFLOAT"):  # fmt: skip
            stack.append(arg)
        elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
            stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[name])
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo[arg])
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, attr = arg.split(" ", 1)
            else:
                attr, module = stack.pop(), stack.pop()
            stack.append(_global(path, module, attr))
        elif name == "BINPERSID":
            stack.append(storage_of(stack.pop()))
        elif name == "REDUCE":
            args, fn = stack.pop(), stack.pop()
            if fn == _REBUILD:
                stack.append(_rebuild_tensor_v2(*args))
            elif fn == _ORDERED:
                stack.append({})
            else:
                raise TorchFileError(f"{path}: a call of {fn!r} is not part of a plain tensor state dict")
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            stack[-1][key] = value
        elif name == "SETITEMS":
            items = pop_mark()
            target = stack[-1]
            for k in range(0, len(items), 2):
                target[items[k]] = items[k + 1]
        elif name in ("APPEND", "APPENDS"):
            items = [stack.pop()] if name == "APPEND" else pop_mark()
            stack[-1].extend(items)
        elif name == "BUILD":
            stack.pop()  # an OrderedDict's state (torch's _metadata): not needed
        else:
            raise TorchFileError(f"{path}: data.pkl opcode {name} is not part of a plain tensor state dict")
    raise TorchFileError(f"{path}: data.pkl ends without STOP")


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

        def storage_of(pid):
            if not (isinstance(pid, tuple) and len(pid) == 5):
                raise TorchFileError(f"{path}: persistent id {pid!r} is not a storage")
            kind, storage, key, _location, numel = pid
            if kind != "storage" or not isinstance(storage, _StorageType):
                raise TorchFileError(f"{path}: storage {pid!r} is not a float storage")
            data = np.frombuffer(z.read(f"{root}data/{key}"), dtype=storage.dtype)
            if data.size != numel:
                raise TorchFileError(f"{path}: storage {key} holds {data.size} values, not {numel}")
            return data

        try:
            state = _interpret(path, z.read(pkl), storage_of)
        except TorchFileError:
            raise
        except Exception as exc:  # a truncated or foreign file
            raise TorchFileError(f"{path}: not a readable state dict ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise TorchFileError(f"{path} is not a state dict of tensors")
    return dict(state)
