"""The ``*ForSequenceClassification`` heads of the families outside encoder.py (whose BERT and
RoBERTa heads stay there, byte-stable), each as transformers computes it in inference (dropout
off), writing ``score`` (a rerank model, one label) or ``logits`` [batch, labels]:

* ``roberta`` (MPNet's ``MPNetClassificationHead`` has RoBERTa's layout): first token, dense,
  tanh, ``out_proj``;
* ``distilbert``: first token, ``pre_classifier``, ReLU, ``classifier``;
* ``deberta``: ``ContextPooler`` (first token, dense, ``pooler_hidden_act``), ``classifier``;
* ``modernbert``: first token or the mean of the real tokens (``classifier_pooling``), then
  ``head`` (dense, ``classifier_activation``, LayerNorm), ``classifier``;
* ``qwen3``: ``score`` (no bias) of the last real token (a decoder's classification token);
* ``qwen3_yes_no``: Qwen3-Reranker's causal-LM form: the language-model head's "yes" logit less
  its "no" logit at the last token, so sigmoid(score) is the card's P(yes) = softmax over the two.
"""

from __future__ import annotations

import numpy as np

from batchgate.gateway.models.encoder import Head, _pool
from batchgate.gateway.models.onnx_graph import GraphBuilder, gelu
from batchgate.gateway.models.rotary import layer_norm, linear

# head kind -> the tensor whose rows are the labels (checked against config.json's id2label)
LABELS_TENSORS = {
    "roberta": "classifier.out_proj.weight",
    "distilbert": "classifier.weight",
    "deberta": "classifier.weight",
    "modernbert": "classifier.weight",
    "qwen3": "score.weight",
}


def _activate(g: GraphBuilder, name: str, x: str, act: str) -> str:
    if act == "gelu":  # transformers' "gelu": the exact (erf) form
        return gelu(g, f"{name}.gelu", x, one=g.const(f"{name}.one", np.array(1.0, np.float32)))
    return g.op({"tanh": "Tanh", "relu": "Relu"}[act], [x], f"{name}.{act}")


def classify(g: GraphBuilder, x: str, mask: str, head: Head, w: dict[str, np.ndarray], *, act: str = "gelu",
             pooling: str = "cls", norm_eps: float = 1e-5) -> str:  # fmt: skip
    """[batch, seq, hidden] final states -> ``score`` or ``logits`` (``act``, ``pooling`` and
    ``norm_eps``: ModernBERT's classifier_activation, classifier_pooling and norm_eps, DeBERTa's
    pooler_hidden_act)."""
    out = "logits" if head.kind == "classification" else "score"
    kind = head.classifier
    if kind in ("qwen3", "qwen3_yes_no"):
        last = _pool(g, x, mask, "lasttoken")
        if kind == "qwen3":
            weight = g.const("score.weight", np.ascontiguousarray(w["score.weight"].T, np.float32))
            return g.op("MatMul", [last, weight], out)  # (no bias)
        # [yes, no] logits in one GEMM, then their difference: [batch, 1].
        both = linear(g, "yes_no", last, w["yes_no.weight"])
        yes, no = g.ops(
            "Split", [both, g.const("yes_no_split", np.array([1, 1], np.int64))], ["yes", "no"], axis=-1
        )
        return g.op("Sub", [yes, no], out)
    if kind == "modernbert" and pooling == "mean":
        pooled = _pool(g, x, mask, "mean")
    else:  # (a 0-d index: the base const, which _Graph's would store as [1])
        pooled = g.op(
            "Gather", [x, GraphBuilder.const(g, "first_token", np.array(0, np.int64))], "first_state", axis=1
        )
    if kind == "roberta":
        h = g.op("Tanh", [linear(g, "head", pooled, w["classifier.dense.weight"], w["classifier.dense.bias"])],
                 "head_out")  # fmt: skip
        return linear(g, out, h, w["classifier.out_proj.weight"], w["classifier.out_proj.bias"])
    if kind == "distilbert":
        h = linear(g, "pre_classifier", pooled, w["pre_classifier.weight"], w["pre_classifier.bias"])
        h = g.op("Relu", [h], "pre_classifier_relu")
    elif kind == "deberta":
        h = _activate(
            g, "pooler", linear(g, "pooler", pooled, w["pooler.dense.weight"], w["pooler.dense.bias"]), act
        )
    elif kind == "modernbert":
        h = _activate(
            g, "head", linear(g, "head", pooled, w["head.dense.weight"], w.get("head.dense.bias")), act
        )
        h = layer_norm(g, "head.norm", h, w["head.norm.weight"], w.get("head.norm.bias"), norm_eps)
    else:
        raise ValueError(f"no classifier head '{kind}'")
    return linear(g, out, h, w["classifier.weight"], w["classifier.bias"])
