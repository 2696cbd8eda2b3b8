"""Which library types the REST bodies (gateway/transport/bodies.py): decode + validate cost per
call of two realistic bodies, msgspec (``Struct`` + ``msgspec.json.decode``) against pydantic v2
(``BaseModel.model_validate_json``), with ``json.loads`` (what the hand-written checks started
from) as the floor. Same bodies, same field types in both libraries, alternated rounds, best round
per library (a shared machine's bursts seldom hit every round).

    .venv/bin/python -m lab.body_decode [--rounds 5] [--number 2000] [--before main]

``--before REF`` also times the wires' own parse, this tree's against REF's (read with ``git show``,
imported beside): a ``/v1/embeddings`` body into its ``TextCall`` and a KServe infer body into
its ``Call`` (``build_request``), alternated in the same rounds.

Bodies: an OpenAI ``/v1/embeddings`` call of 8 sentences (what LangChain sends in a batch) and a
KServe REST infer body of one BYTES tensor of 8 texts (``minilm``'s input, ``[8, 1]``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any, Literal

import msgspec
import pydantic

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
]  # fmt: skip
EMBEDDINGS = json.dumps({"model": "minilm", "input": SENTENCES, "encoding_format": "float"}).encode()
INFER = json.dumps({
    "id": "42", "inputs": [{"name": "text", "shape": [8, 1], "datatype": "BYTES", "data": SENTENCES}],
    "outputs": [{"name": "embedding", "parameters": {"binary_data": False}}],
}).encode()  # fmt: skip


# -- msgspec ---------------------------------------------------------------------------------------


class MEmbeddings(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class MTensor(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, bool | int | float | str] | None = None
    data: Any = msgspec.UNSET


class MWanted(msgspec.Struct):
    name: str
    parameters: dict[str, bool | int | float | str] | None = None


class MInfer(msgspec.Struct):
    inputs: list[MTensor]
    id: str = ""
    parameters: dict[str, bool | int | float | str] | None = None
    outputs: list[MWanted] | None = None


# -- pydantic --------------------------------------------------------------------------------------


class PEmbeddings(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class PTensor(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True)
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, bool | int | float | str] | None = None
    data: Any = None


class PWanted(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True)
    name: str
    parameters: dict[str, bool | int | float | str] | None = None


class PInfer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True)
    inputs: list[PTensor]
    id: str = ""
    parameters: dict[str, bool | int | float | str] | None = None
    outputs: list[PWanted] | None = None


def cases() -> dict[str, dict[str, Any]]:
    m_emb, m_inf = msgspec.json.Decoder(MEmbeddings), msgspec.json.Decoder(MInfer)
    return {
        "embeddings": {
            "json.loads": lambda: json.loads(EMBEDDINGS),
            "msgspec": lambda: m_emb.decode(EMBEDDINGS),
            "pydantic": lambda: PEmbeddings.model_validate_json(EMBEDDINGS),
        },
        "kserve infer": {
            "json.loads": lambda: json.loads(INFER),
            "msgspec": lambda: m_inf.decode(INFER),
            "pydantic": lambda: PInfer.model_validate_json(INFER),
        },
    }


def _old(ref: str, tmp: Path, name: str, path: str, rename: dict[str, str]):
    """REF's ``path`` imported as module ``name`` (its imports of ``rename``'s keys redirected)."""
    src = subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True, text=True).stdout
    for a, b in rename.items():
        src = src.replace(a, b)
    file = tmp / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wires(ref: str) -> dict[str, dict[str, Any]]:
    """The wires' parse of both bodies, this tree's and ``ref``'s."""
    from aiohttp.test_utils import make_mocked_request

    from batchgate.gateway.transport import bodies, kserve_rest, openai

    tmp = Path(tempfile.mkdtemp())
    _old(ref, tmp, "old_fields", "gateway/transport/fields.py", {})
    old_openai = _old(ref, tmp, "old_openai", "gateway/transport/openai.py",
                      {"batchgate.gateway.transport.fields": "old_fields"})  # fmt: skip
    old_kserve = _old(ref, tmp, "old_kserve_rest", "gateway/transport/kserve_rest.py", {})
    request = make_mocked_request("POST", "/v1/embeddings")
    allowed = old_openai._EMBEDDINGS.fields

    def before_embeddings():  # json_object's checks, then the call (the body already read)
        doc = json.loads(EMBEDDINGS)
        if not isinstance(doc, dict) or any(k not in allowed for k in doc):
            raise AssertionError
        return old_openai.embeddings_call(request, doc)

    def after_embeddings():
        return openai.embeddings_call(
            request, bodies.read(EMBEDDINGS, bodies.EmbeddingsRequest, "/v1/embeddings")
        )

    return {
        "embeddings → TextCall": {"before": before_embeddings, "after": after_embeddings},
        "kserve infer → Call": {
            "before": lambda: old_kserve.build_request("minilm", "", INFER, None),
            "after": lambda: kserve_rest.build_request("minilm", "", INFER, None),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=2000, help="calls per library and round")
    ap.add_argument("--before", default="", metavar="REF", help="also time the wires' parse against REF's")
    args = ap.parse_args(argv)
    print(f"msgspec {msgspec.__version__}, pydantic {pydantic.VERSION}; best of {args.rounds} rounds")
    table = cases()
    if args.before:
        table.update(wires(args.before))
    for body, fns in table.items():
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.rounds):  # alternated: a burst of other load hits one round of each
            for name, fn in fns.items():
                best[name] = min(best[name], timeit.timeit(fn, number=args.number) / args.number)
        row = ", ".join(f"{name} {s * 1e6:.2f} µs" for name, s in best.items())
        if "pydantic" in best:
            print(f"{body:22s} {row}; pydantic/msgspec {best['pydantic'] / best['msgspec']:.2f}x")
        else:
            print(f"{body:22s} {row}; before/after {best['before'] / best['after']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
