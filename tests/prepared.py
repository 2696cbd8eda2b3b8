"""Helpers shared by the tests of prepared classifiers, sparse encoders and token embeddings
(tests/test_classify.py, test_sparse.py, test_token_embeddings.py): the tiny models' configs,
transformers' inputs for a folder's rows, the served repository (fixtures ``server`` and ``client``
over a module's ``repo`` fixture), and one KServe call by gRPC or REST."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as tc
from tokenizers import Tokenizer

from batchgate.gateway.models.hf_model import read_folder
from tests.conftest import start_server
from tests.test_prepare_model import TINY, unigram, wordpiece


def tiny_configs():
    """(the BERT config's fields with the WordPiece tokenizer, XLM-R's with the Unigram one, those
    two tokenizers): tests/test_prepare_model.py's tiny models, for ``transformers_folder``
    (tests/tiny_models.py: numpy weights, so the tests that do not compare with transformers run
    without torch)."""
    wp, ug = wordpiece(), unigram()
    bert = dict(TINY, vocab_size=wp.get_vocab_size(), max_position_embeddings=64)
    # XLM-R: one token type, padding_idx 1, positions from 2, so 40 rows hold 38 tokens.
    xlmr = dict(TINY, vocab_size=ug.get_vocab_size(), max_position_embeddings=40, type_vocab_size=1,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)  # fmt: skip
    return bert, xlmr, wp, ug


def torch_feeds(folder, model, rows: list) -> dict:
    """transformers' inputs for ``rows`` (texts, or pairs as tuples) in one padded batch,
    tokenised by the folder's tokenizer with its real pad token, cut at the model's max length."""
    torch = pytest.importorskip("torch")  # the reference tests' own: they skip without it

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    pad = "[PAD]" if tok.token_to_id("[PAD]") is not None else "<pad>"
    tok.enable_padding(pad_id=tok.token_to_id(pad), pad_token=pad)
    tok.enable_truncation(read_folder(folder).max_tokens)
    enc = tok.encode_batch(rows)
    feeds = {"input_ids": torch.tensor([e.ids for e in enc]),
             "attention_mask": torch.tensor([e.attention_mask for e in enc])}  # fmt: skip
    if model.config.model_type == "bert":  # XLM-R's and DistilBERT's tokenizers send no token types
        feeds["token_type_ids"] = torch.tensor([e.type_ids for e in enc])
    return feeds


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"), "--no-build-models", repo=repo, ready_timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    c = tc.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def kserve_grpc(client, model: str, rows: list[str], outputs: list[str] | None = None):
    inp = tc.InferInput("text", [len(rows), 1], "BYTES")
    inp.set_data_from_numpy(np.array([r.encode() for r in rows], dtype=object).reshape(-1, 1))
    wanted = [tc.InferRequestedOutput(o) for o in outputs] if outputs else None
    return client.infer(model, [inp], outputs=wanted, client_timeout=60)


def kserve_rest(
    server, model: str, rows: list[str], outputs: list[str] | None = None
) -> dict[str, np.ndarray]:
    """KServe v2 REST ``POST /v2/models/{model}/infer`` (JSON): output name -> array."""
    body = {"inputs": [{"name": "text", "shape": [len(rows), 1], "datatype": "BYTES", "data": rows}]}
    if outputs:
        body["outputs"] = [{"name": o} for o in outputs]
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    return {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in answer["outputs"]}
