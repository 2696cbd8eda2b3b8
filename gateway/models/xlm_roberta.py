"""The tokenizer an XLM-RoBERTa model is served with (``model_type`` xlm-roberta: XLM-R, BGE-M3,
multilingual-e5, their cross-encoders). The graph is RoBERTa's (encoder.py).

transformers 5's ``XLMRobertaTokenizer`` — what sentence-transformers, FlagEmbedding and the
cards' code load — keeps ``tokenizer.json``'s Unigram vocabulary and its sentencepiece
``Precompiled`` character map, but builds the rest itself: no other normaliser step (the file's
space-run ``Replace``, or any other, is dropped), ``WhitespaceSplit`` then ``Metaspace`` as the
pre-tokenizer, and ``<s> A </s>`` / ``<s> A </s> </s> B </s>`` around the tokens. The file (as
transformers 4 converted it from sentencepiece) keeps a trailing space the map leaves: a text
ending in a newline, a tab or spaces (as split documents often do) gets one more ``▁`` token
there than the reference feeds the model. Served as the reference builds it.
"""

from __future__ import annotations

import json
from pathlib import Path

from batchgate.gateway.models.sources import special_token, tokenizer_config


def served_tokenizer(model_dir: Path, tokenizer: Path) -> bytes:
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors

    config = tokenizer_config(model_dir)
    raw = json.loads(tokenizer.read_text(encoding="utf-8"))
    tok = Tokenizer.from_str(json.dumps(raw))
    steps = raw.get("normalizer") or {}
    steps = steps.get("normalizers", []) if steps.get("type") == "Sequence" else [steps]
    charsmap = next(
        (s for s in steps if s.get("type") == "Precompiled" and s.get("precompiled_charsmap")), None
    )
    if charsmap is not None:
        import base64

        tok.normalizer = normalizers.Precompiled(base64.b64decode(charsmap["precompiled_charsmap"]))
    else:
        tok.normalizer = None
    scheme = "always" if config.get("add_prefix_space", True) else "never"
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    bos, eos = special_token(config, "bos_token", "<s>"), special_token(config, "eos_token", "</s>")
    tok.post_processor = processors.TemplateProcessing(
        single=[bos, "$A", eos],
        pair=[bos, "$A", eos, eos, "$B", eos],
        special_tokens=[(bos, tok.token_to_id(bos) or 0), (eos, tok.token_to_id(eos) or 2)],
    )
    return tok.to_str().encode()
