"""Cohere's embedding types (gateway/vector_types.py) on minilm's real vectors: binary/ubinary and
int8/uint8 equal sentence-transformers' ``quantize_embeddings`` bit for bit; int8/uint8 ranges are
calibrated once on the shipped held-out rows, kept in a file with the model, one per served size."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from batchgate.gateway import vector_types as vt

# rows the calibration never saw, odd ones included
FRESH = [
    "A man is eating food.",
    "   ",
    "!!!???...",
    "0.000001 1e-300 -42 9999999999",
    "https://example.com/a/b?c=d#e",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "😀👍🏽🇳🇴",
    "Größe naïve café 日本語 한국어 العربية",
    "word " * 300,
]


@pytest.fixture(scope="module")
def embed(minilm_dir):
    """minilm's vectors through its ONNX file, as the server's text stage feeds it (its tokenizer,
    cut at max_tokens 256, padded batches)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(minilm_dir / "1" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.enable_truncation(256)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    calls = []
    seen: dict[str, np.ndarray] = {}  # each text computed once per module (CPU time, not meaning)

    def run(texts: list[str]) -> np.ndarray:
        calls.append(len(texts))
        todo = [t for t in dict.fromkeys(texts) if t not in seen]
        if todo:
            enc = tok.encode_batch(todo)
            feeds = {
                "input_ids": np.array([e.ids for e in enc], np.int64),
                "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
                "token_type_ids": np.array([e.type_ids for e in enc], np.int64),
            }
            seen.update(zip(todo, sess.run(["embedding"], feeds)[0]))
        return np.stack([seen[t] for t in texts])

    run.calls = calls
    return run


@pytest.fixture(scope="module")
def calibrated(embed):
    """(the ranges at sizes 384, 256, 128, 64, the calibration rows' full vectors)."""
    texts = vt.default_texts()[0][::2] + [" "]  # every kind of row, half of them: CPU time
    ranges = vt.Ranges.calibrate(embed, texts, sizes=(64, 128, 256))
    return ranges, embed(texts)


@pytest.fixture(scope="module")
def fresh(embed):
    return embed(FRESH)


@pytest.fixture(scope="module")
def st_quantize():
    """sentence-transformers' own ``quantize_embeddings``: its module util/quantization.py (and the
    util/tensor.py it imports) loaded from the installed package under a private name, without the
    package's __init__, which imports transformers, scikit-learn and torch.distributed first (47 s
    of 60 here on a loaded machine; torch and scipy, which the two modules import, stay)."""
    spec = importlib.util.find_spec("sentence_transformers")  # finds the package, runs none of it
    if spec is None:
        pytest.skip("sentence-transformers (the reference extra) is not installed")
    util = types.ModuleType("_sentence_transformers_util")
    util.__path__ = [str(Path(spec.origin).parent / "util")]
    sys.modules[util.__name__] = util
    try:
        return importlib.import_module(util.__name__ + ".quantization").quantize_embeddings
    finally:
        del sys.modules[util.__name__]


def test_default_texts_are_the_shipped_held_out_rows():
    texts, source = vt.default_texts()
    assert source["files"] == ["gateway/models/texts/calibration.txt", "gateway/models/texts/heldout.txt"]
    assert len(texts) > 300 and not any(t.startswith("#") for t in texts)
    assert [t for t in texts if not t.strip()] == [" "] == texts[-1:]  # the one whitespace-only row
    # odd rows are among them, not only sentences
    assert any("http" in t for t in texts) and any(not t.isascii() for t in texts)


def test_calibration_defaults_to_the_shipped_rows():
    seen = []

    def embed(texts):  # any vectors do: this is about which rows and what the file says of them
        seen.extend(texts)
        return np.array([[len(t), -len(t), t.count(" ")] for t in texts], np.float32)

    ranges = vt.Ranges.calibrate(embed)
    texts, source = vt.default_texts()
    assert sorted(seen) == sorted(texts) and ranges.rows == len(texts)
    assert ranges.describe()["texts"] == source
    longest = max(len(t) for t in texts)
    assert ranges.for_size(3)[:, 0].tolist() == [min(len(t) for t in texts), longest]


@pytest.mark.parametrize("kind", ["binary", "ubinary"])
def test_binary_kinds_equal_sentence_transformers(kind, fresh, calibrated, st_quantize):
    ranges, calib = calibrated
    for vectors in (fresh, calib, vt.cut(fresh, 64)):
        ours = vt.quantize(vectors, kind)
        theirs = st_quantize(vectors, kind)
        assert ours.dtype == theirs.dtype == (np.int8 if kind == "binary" else np.uint8)
        assert ours.shape == (len(vectors), vectors.shape[1] // 8)
        assert ours.tobytes() == theirs.tobytes()
    # the packed signs, read back: bit 7 of byte 0 is dimension 0
    signs = np.unpackbits(vt.quantize(fresh, "ubinary"), axis=-1)
    assert (signs == (fresh > 0)).all()
    if kind == "binary":  # Cohere's: ubinary - 128
        assert (
            vt.quantize(fresh, "binary").astype(int) == vt.quantize(fresh, "ubinary").astype(int) - 128
        ).all()


@pytest.mark.parametrize("kind", ["int8", "uint8"])
def test_calibrated_kinds_equal_sentence_transformers(kind, fresh, calibrated, st_quantize):
    ranges, calib = calibrated
    full = ranges.for_size(384)
    # the file's ranges are the calibration rows' min and max, as sentence-transformers takes them
    assert np.array_equal(full, st_quantize_ranges(calib))
    for vectors in (fresh, calib):
        ours = vt.quantize(vectors, kind, full)
        assert ours.dtype == np.dtype(kind) and ours.shape == vectors.shape
        assert ours.tobytes() == st_quantize(vectors, kind, ranges=full).tobytes()
        assert ours.tobytes() == st_quantize(vectors, kind, calibration_embeddings=calib).tobytes()
    # the calibration rows span the whole scale in every dimension (the max lands in 254 or 255:
    # float32 steps, as sentence-transformers computes them)
    q = vt.quantize(calib, "uint8", full).astype(int)
    assert (q.min(axis=0) == 0).all() and (q.max(axis=0) >= 254).all()


def st_quantize_ranges(calib: np.ndarray) -> np.ndarray:
    return np.vstack((calib.min(axis=0), calib.max(axis=0)))


def test_float_is_the_vectors(fresh):
    assert vt.quantize(fresh, "float").tobytes() == fresh.astype(np.float32).tobytes()


def test_matryoshka_sizes_have_their_own_ranges(fresh, calibrated, st_quantize):
    ranges, calib = calibrated
    assert sorted(ranges.by_size) == [64, 128, 256, 384]
    for size in (64, 128, 256):
        cut_calib, cut_fresh = vt.cut(calib, size), vt.cut(fresh, size)
        r = ranges.for_size(size)
        assert np.array_equal(r, st_quantize_ranges(cut_calib))
        # re-normalised cut values are larger: the full vectors' leading ranges would not fit them
        assert (r[1] - r[0] > ranges.for_size(384)[:, :size][1] - ranges.for_size(384)[:, :size][0]).all()
        ours = vt.quantize(cut_fresh, "int8", r)
        theirs = st_quantize(cut_fresh, "int8", calibration_embeddings=cut_calib)
        assert ours.tobytes() == theirs.tobytes()
        # the full size's ranges clip many more of the cut values to the ends of the scale
        clipped = [np.isin(vt.quantize(cut_fresh, "uint8", rr), (0, 255)).mean()
                   for rr in (ranges.for_size(384)[:, :size], r)]  # fmt: skip
        assert clipped[0] > 2 * clipped[1], (size, clipped)
    with pytest.raises(KeyError, match="sizes \\[64, 128, 256, 384\\], not 32"):
        ranges.for_size(32)


def test_uint8_keeps_the_vectors(fresh, calibrated):
    """What the ranges are for: each fresh row's uint8 buckets, read back as their middles, point
    where its float vector points."""
    r = calibrated[0].for_size(384)
    steps = (r[1] - r[0]) / 255
    back = r[0] + (vt.quantize(fresh, "uint8", r).astype(np.float32) + 0.5) * steps
    cos = (back * fresh).sum(1) / np.linalg.norm(back, axis=1) / np.linalg.norm(fresh, axis=1)
    # 0.996-1.0 here (half the rows calibrated); 0.998-1.0 with all of them (docs/embeddings.md)
    assert cos.min() > 0.99 and np.median(cos) > 0.999, cos


def test_save_load_and_describe(tmp_path, calibrated):
    ranges, _ = calibrated
    saved = ranges.save(tmp_path / vt.RANGES_FILE)
    loaded = vt.Ranges.load(tmp_path / vt.RANGES_FILE)
    for size, r in ranges.by_size.items():
        assert loaded.for_size(size).tobytes() == r.tobytes()  # the same float32 bits
    info = loaded.describe()
    assert info["file"] == "vector_ranges.json" and info["rows"] == ranges.rows > 150
    assert info["made"] == ranges.made and info["sizes"] == [64, 128, 256, 384]
    assert info["texts"]["sha256"] == ranges.texts["sha256"] and len(info["texts"]["sha256"]) == 64
    assert "quantize_embeddings" in info["how"] and saved.file == tmp_path / vt.RANGES_FILE
    assert (tmp_path / vt.RANGES_FILE).stat().st_size < 100_000
    assert [p.name for p in tmp_path.iterdir()] == [vt.RANGES_FILE]  # no temporary left


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda d: d.update(format=2), "format 2, expected 1"),
        (lambda d: d["sizes"]["384"]["min"].pop(), "size 384: expected 384"),
        (lambda d: d["sizes"]["64"]["min"].__setitem__(0, 5.0), "size 64: expected 64 finite min <= max"),
        (lambda d: d.pop("rows"), "KeyError"),
        (lambda d: d.update(sizes={}), "no sizes"),
    ],
)
def test_a_bad_file_is_named(tmp_path, calibrated, edit, why):
    ranges, _ = calibrated
    path = ranges.save(tmp_path / vt.RANGES_FILE).file
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"vector ranges {path}: .*{why}"):
        vt.Ranges.load(path)


def test_ensure_calibrates_once_per_model(tmp_path, embed):
    texts = vt.default_texts()[0][:40]
    model = {"file": "model.onnx", "sha256": "a" * 64}
    lines = []
    before = len(embed.calls)
    first = vt.ensure(tmp_path, embed, sizes=(128,), model=model, texts=texts, log=lines.append)
    assert len(embed.calls) - before == 2  # 40 rows in batches of 32
    assert first.file == tmp_path / vt.RANGES_FILE and "missing before" in lines[-1]
    again = vt.ensure(tmp_path, embed, sizes=(128, 384), model=model, texts=texts)
    assert len(embed.calls) - before == 2 and again.made == first.made  # read back, not recalibrated
    vt.ensure(tmp_path, embed, sizes=(64, 128), model=model, texts=texts, log=lines.append)
    assert "lack some of [64, 128]" in lines[-1]
    vt.ensure(
        tmp_path, embed, sizes=(64,), model={**model, "sha256": "b" * 64}, texts=texts, log=lines.append
    )
    assert "another model file" in lines[-1] and len(embed.calls) - before == 6


def test_wrong_use_is_refused(fresh):
    with pytest.raises(ValueError, match="int8 vectors need the model's calibrated ranges"):
        vt.quantize(fresh, "int8", None)
    with pytest.raises(ValueError, match=r"ranges of shape \(2, 64\) do not fit 384-dim"):
        vt.quantize(fresh, "uint8", np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="embedding type must be one of float, int8, uint8, binary, ubinary"):
        vt.quantize(fresh, "int4")
    with pytest.raises(ValueError, match="at least 2 texts"):
        vt.Ranges.calibrate(lambda t: np.zeros((len(t), 4), np.float32), ["one"])


def test_an_async_caller_builds_ranges_from_its_own_vectors(tmp_path, calibrated):
    ranges, calib = calibrated
    model = {"file": "model.onnx", "sha256": "c" * 64}
    built = vt.Ranges.from_vectors(calib, sizes=(64, 128, 256, 384, 999), model=model)
    assert sorted(built.by_size) == [64, 128, 256, 384] and built.rows == len(calib)
    for size, r in ranges.by_size.items():
        assert built.for_size(size).tobytes() == r.tobytes()
    assert vt.usable(tmp_path, (64,), model) == (None, "missing")
    lines = []
    vt.save_beside(tmp_path, built, "missing", lines.append)
    found, why = vt.usable(tmp_path, (64, 384), model)
    assert found is not None and why == "" and found.file == tmp_path / vt.RANGES_FILE
    assert vt.usable(tmp_path, (32,), model)[1] == "sizes [64, 128, 256, 384] lack some of [32]"
    # a version directory that cannot take the file: the ranges still serve, from memory
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    kept = vt.save_beside(blocked, built, log=lines.append)
    assert kept.file is None and "kept in memory" in lines[-1]
    with pytest.raises(ValueError, match="at least 2 rows"):
        vt.Ranges.from_vectors(calib[:1])
