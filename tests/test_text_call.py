"""The text call is decided once: whichever wire a text call comes on, the pipeline looks its
model up twice (before admission, and after it: a reload may have swapped the model while a
Redis decision was awaited), and no transport module looks a model up or imports another wire."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness import REPO, serving

TRANSPORT = Path(__file__).resolve().parent.parent / "gateway" / "transport"
WIRES = ("openai", "tei", "cohere", "vllm", "kserve_rest", "grpc", "tei_grpc")


def _repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    (repo / "minilm").symlink_to(REPO / "minilm")
    return repo


async def test_a_text_call_looks_its_model_up_twice_on_every_wire(tmp_path, monkeypatch):
    async with serving(_repo(tmp_path)) as gw:
        plane = gw.server.plane
        real, seen = type(plane).get, []

        def counted(self, name, version=""):
            seen.append(name)
            return real(self, name, version)

        monkeypatch.setattr(type(plane), "get", counted)
        calls = [
            ("/v1/embeddings", {"model": "minilm", "input": ["one", "two", "three"], "dimensions": 384}),
            ("/embeddings", {"model": "minilm", "input": "one"}),
            ("/embed", {"inputs": ["one", "two"], "truncate": True}),
            ("/", {"inputs": "one"}),
            ("/tei/minilm/embed", {"inputs": "one"}),
            ("/v2/embed", {"model": "minilm", "texts": ["one"], "input_type": "search_query"}),
        ]
        for path, body in calls:
            seen.clear()
            async with gw.http.post(path, json=body) as r:
                assert r.status == 200, (path, await r.text())
            assert seen == ["minilm", "minilm"], (path, seen)


def test_no_transport_module_looks_a_model_up_or_imports_another_wire():
    for path in sorted(TRANSPORT.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "get"
                and isinstance(node.value, ast.Attribute)
            ):
                assert node.value.attr != "plane", f"{path.name}:{node.lineno} looks a model up (plane.get)"
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("batchgate.gateway.transport")
            ):
                names = {node.module.rsplit(".", 1)[-1], *(a.name for a in node.names)}
                if path.stem in WIRES:
                    assert not names & set(WIRES) - {path.stem}, f"{path.name} imports another wire: {names}"


def test_pipeline_texts_takes_at_most_four_parameters():
    import inspect

    from batchgate.gateway.infer import Pipeline

    assert len(inspect.signature(Pipeline.texts).parameters) <= 4  # self, pass_, edge, call
