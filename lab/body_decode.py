"""Which library types the REST bodies (gateway/transport/bodies.py): decode + validate cost per
call of two realistic bodies, msgspec (``Struct`` + ``msgspec.json.decode``) against pydantic v2
(``BaseModel.model_validate_json``), with ``json.loads`` (what the hand-written checks started
from) as the floor. Same bodies, same field types in both libraries, alternated rounds, best round
per library (a shared machine's bursts seldom hit every round).

    .venv/bin/python -m lab.body_decode [--rounds 5] [--number 2000]

Bodies: an OpenAI ``/v1/embeddings`` call of 8 sentences (what LangChain sends in a batch) and a
KServe REST infer body of one BYTES tensor of 8 texts (``minilm``'s input, ``[8, 1]``).
"""

from __future__ import annotations

import argparse
import json
import timeit
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=2000, help="calls per library and round")
    args = ap.parse_args(argv)
    print(f"msgspec {msgspec.__version__}, pydantic {pydantic.VERSION}; best of {args.rounds} rounds")
    for body, fns in cases().items():
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(args.rounds):  # alternated: a burst of other load hits one round of each
            for name, fn in fns.items():
                best[name] = min(best[name], timeit.timeit(fn, number=args.number) / args.number)
        row = ", ".join(f"{name} {s * 1e6:.2f} µs" for name, s in best.items())
        print(f"{body:13s} {row}; pydantic/msgspec {best['pydantic'] / best['msgspec']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
