"""The tokenizer an XLM-R model is served with is the one its reference feeds it: transformers 5's
``XLMRobertaTokenizer`` (gateway/models/xlm_roberta.py), not the folder's ``tokenizer.json`` as it
stands, on the texts where the two differ (trailing newlines or spaces) and on
those where the sentencepiece character map must still apply (a ligature, full-width letters)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, processors

from batchgate.gateway.models import xlm_roberta
from tests.test_prepare_model import unigram


TEXTS = ["the dog", "the dog\n", " the dog", "the\tdog", "the  dog  ", "\u3000a man is eating",
         "a ﬁsh and Ａ ｄog", "a man\n\nis eating food\n"]  # fmt: skip
PAIRS = [("the dog\n", " a cat"), ("a man\tis", "eating food")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An XLM-R tokenizer laid out as xlm-roberta-base's files are (unigram(): the map and a
    space-run Replace as the normaliser, Metaspace), with <s> A </s> </s> B </s> as a template."""
    d = tmp_path_factory.mktemp("xlmr-tokenizer")
    tok = unigram()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tok.save(str(d / "tokenizer.json"))
    special = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
               "unk_token": "<unk>", "sep_token": "</s>", "mask_token": "<mask>"}  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps(dict(special, tokenizer_class="XLMRobertaTokenizer")))
    (d / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}))
    return d


def test_served_ids_are_what_transformers_feeds_the_model(folder):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    served = Tokenizer.from_str(xlm_roberta.served_tokenizer(folder, folder / "tokenizer.json").decode())
    as_file = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert served.encode(text).ids == reference(text)["input_ids"], repr(text)
    for a, b in PAIRS:
        assert served.encode(a, b).ids == reference(a, b)["input_ids"], (a, b)
    # the map still applies (the ligature and full-width letters become known pieces)...
    assert served.encode("a ﬁsh and Ａ ｄog").ids == served.encode("a fish and A dog").ids
    # ...which only the folder's sentencepiece map does: without a normalizer they stay apart
    bare = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bare.normalizer = None
    assert bare.encode("a ﬁsh and Ａ ｄog").ids != bare.encode("a fish and A dog").ids
    # ...and the file as it stands tokenises the whitespace cases otherwise: this test compares
    # something that differs.
    differ = [t for t in TEXTS if as_file.encode(t).ids != reference(t)["input_ids"]]
    assert {"the dog\n", "the  dog  ", "a man\n\nis eating food\n"} <= set(differ), differ
