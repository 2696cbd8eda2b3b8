"""BGE-M3's two extra heads (FlagEmbedding's ``EncoderOnlyEmbedderM3Model``), built into the same
graph as its XLM-R encoder so one pass answers all three of its outputs:

* ``embedding``: the CLS state, L2-normalised (the folder's own Pooling and Normalize, encoder.py);
* ``sparse_embedding`` [vocab]: ``relu(sparse_linear(state))`` per token, the largest per token id
  over the text, the tokenizer's CLS, EOS, PAD and UNK ids dropped (FlagEmbedding's
  ``_process_token_weights``): a vocabulary-sized vector, zero for every id the text lacks;
* ``token_embeddings`` [-1, colbert dim]: ``colbert_linear(state)`` of every token after CLS,
  L2-normalised (FlagEmbedding's ``_colbert_embedding``), aligned with the input's positions;
  ``token_mask`` [-1] says which rows are the text's vectors (1: the tokens after CLS, the
  final ``</s>`` included, as FlagEmbedding keeps ``colbert_vecs[:tokens - 1]``; 0: CLS and
  padding, whose rows are zero).

The heads are read from the folder's ``colbert_linear.pt`` and ``sparse_linear.pt`` (torch.save
state dicts, read by torch_file.py without PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from batchgate.gateway.models.onnx_graph import GraphBuilder

COLBERT_FILE, SPARSE_FILE = "colbert_linear.pt", "sparse_linear.pt"
# The token kinds FlagEmbedding leaves out of the sparse weights (tokenizer attributes).
DROPPED = ("cls_token", "eos_token", "pad_token", "unk_token")
# BGE-M3's card scores a pair with weights_for_different_modes=[0.4, 0.2, 0.4]: dense, sparse, ColBERT.
CARD_WEIGHTS = (0.4, 0.2, 0.4)
NORM_EPSILON = 1e-12  # F.normalize's


@dataclass(frozen=True, eq=False)
class M3Heads:
    colbert_weight: np.ndarray  # [dim, hidden], torch Linear's layout
    colbert_bias: np.ndarray  # [dim]
    sparse_weight: np.ndarray  # [1, hidden]
    sparse_bias: np.ndarray  # [1]
    dropped_ids: tuple[int, ...]  # token ids whose sparse weight is dropped
    vocab: int

    @property
    def dim(self) -> int:
        return int(self.colbert_weight.shape[0])

    def add(self, g: GraphBuilder, x: str, mask: str) -> None:
        add_heads(g, x, mask, self)


def present(model_dir: Path) -> bool:
    """Whether the folder carries BGE-M3's heads (both files, as FlagEmbedding loads them)."""
    return (model_dir / COLBERT_FILE).is_file() and (model_dir / SPARSE_FILE).is_file()


def read_heads(model_dir: Path, hidden: int, vocab: int, dropped_ids: tuple[int, ...]) -> M3Heads:
    """The two heads' weights, checked against the encoder's hidden size; ValueError naming the file."""
    from batchgate.gateway.models.torch_file import read_state_dict

    found = {}
    for name, rows in ((COLBERT_FILE, None), (SPARSE_FILE, 1)):
        state = read_state_dict(model_dir / name)
        weight, bias = state.get("weight"), state.get("bias")
        if weight is None or bias is None or weight.ndim != 2 or weight.shape[1] != hidden:
            got = {k: list(v.shape) for k, v in state.items()}
            raise ValueError(
                f"{model_dir / name}: expected a Linear's weight [{rows or 'dim'}, {hidden}] and bias; found {got}"
            )
        if (rows is not None and weight.shape[0] != rows) or bias.shape != (weight.shape[0],):
            raise ValueError(f"{model_dir / name}: weight {list(weight.shape)}, bias {list(bias.shape)}")
        found[name] = (weight, bias)
    return M3Heads(*found[COLBERT_FILE], *found[SPARSE_FILE], dropped_ids=dropped_ids, vocab=vocab)


def _linear(g: GraphBuilder, name: str, x: str, weight: np.ndarray, bias: np.ndarray) -> str:
    w = g.const(f"{name}.weight", np.ascontiguousarray(weight.T.astype(np.float32)))
    return g.op("Add", [g.op("MatMul", [x, w], f"{name}.matmul"), g.const(f"{name}.bias", bias.astype(np.float32))],
                name)  # fmt: skip


def add_heads(g: GraphBuilder, x: str, mask: str, heads: M3Heads) -> None:
    """``sparse_embedding``, ``token_embeddings`` and ``token_mask`` from the final states ``x``
    [batch, seq, hidden] and the float mask [batch, seq]; reads the graph input ``input_ids``."""
    ids = "input_ids"
    # Every position's index (0, 1, …) as float, from a row of ones (no Range: encoder.py's note);
    # CumSum's axis must be 0-d, which _Graph.const would widen to [1].
    ones = g.op("Add", [g.op("Mul", [mask, g.const("m3.zero", np.array(0.0, np.float32))], "m3.zeros"),
                        g.const("m3.one", np.array(1.0, np.float32))], "m3.ones")  # fmt: skip
    index = g.op("Sub", [g.op("CumSum", [ones, GraphBuilder.const(g, "m3.axis1", np.array(1, np.int64))], "m3.count"), "m3.one"],
                 "m3.index")  # fmt: skip

    # -- sparse: relu(sparse_linear) per token, special ids and padding dropped, max per id.
    w = g.op("Relu", [_linear(g, "m3.sparse", x, heads.sparse_weight, heads.sparse_bias)], "m3.relu")
    w = g.op("Squeeze", [w, g.const("m3.last_axis", np.array([2], np.int64))], "m3.token_weight")
    ids3 = g.op("Unsqueeze", [ids, g.const("m3.axis2", np.array([2], np.int64))], "m3.ids3")
    if heads.dropped_ids:
        dropped = g.const("m3.dropped_ids", np.array(heads.dropped_ids, np.int64))
        special = g.op("Cast", [g.op("Equal", [ids3, dropped], "m3.is_dropped3")], "m3.is_dropped3_f",
                       to=TensorProto.FLOAT)  # fmt: skip
        special = g.op("ReduceMax", [special], "m3.is_dropped", axes=[2], keepdims=0)
        keep = g.op("Mul", [mask, g.op("Sub", ["m3.one", special], "m3.not_dropped")], "m3.sparse_keep")
    else:
        keep = mask
    w = g.op("Mul", [w, keep], "m3.kept_weight")  # >= 0; 0 where dropped
    # The largest weight of each id within the row, then one position per id keeps it (the first
    # of equal ones), so a scatter-add of the kept weights is a scatter-max (opset 17 has no
    # ScatterElements "max").
    ids_k = g.op("Unsqueeze", [ids, g.const("m3.axis1_1d", np.array([1], np.int64))], "m3.ids_k")
    same = g.op(
        "Cast", [g.op("Equal", [ids3, ids_k], "m3.same")], "m3.same_f", to=TensorProto.FLOAT
    )  # [b, j, k]
    w_k = g.op("Unsqueeze", [w, "m3.axis1_1d"], "m3.w_k")
    best = g.op("ReduceMax", [g.op("Mul", [same, w_k], "m3.same_w")], "m3.best", axes=[2], keepdims=0)
    top = g.op("Cast", [g.op("Equal", [w, best], "m3.is_best")], "m3.is_best_f", to=TensorProto.FLOAT)
    earlier = g.op("Cast", [g.op("Less", [g.op("Unsqueeze", [index, "m3.axis1_1d"], "m3.index_k"),
                                          g.op("Unsqueeze", [index, "m3.axis2"], "m3.index_j")], "m3.k_before_j")],
                   "m3.k_before_j_f", to=TensorProto.FLOAT)  # fmt: skip
    top_k = g.op("Unsqueeze", [top, "m3.axis1_1d"], "m3.top_k")
    rivals = g.op("Mul", [g.op("Mul", [same, top_k], "m3.same_top"), earlier], "m3.rivals")
    first = g.op("Cast", [g.op("Equal", [g.op("ReduceSum", [rivals, "m3.axis2"], "m3.rival_count", keepdims=0),
                                         "m3.zero"], "m3.no_rival")], "m3.first_f", to=TensorProto.FLOAT)  # fmt: skip
    kept = g.op("Mul", [w, g.op("Mul", [top, first], "m3.winner")], "m3.winner_weight")
    rows = g.op("Shape", [ids], "m3.rows", start=0, end=1)
    shape = g.op(
        "Concat", [rows, g.const("m3.vocab", np.array([heads.vocab], np.int64))], "m3.sparse_shape", axis=0
    )
    zeros = g.op("ConstantOfShape", [shape], "m3.sparse_zeros",
                 value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))  # fmt: skip
    g.op("ScatterElements", [zeros, ids, kept], "sparse_embedding", axis=1, reduction="add")

    # -- ColBERT: colbert_linear on every token after CLS, padding zeroed, then L2-normalised.
    after_cls = g.op("Cast", [g.op("Greater", [index, "m3.zero"], "m3.after_cls")], "m3.after_cls_f",
                     to=TensorProto.FLOAT)  # fmt: skip
    token_keep = g.op("Mul", [mask, after_cls], "token_mask")
    c = _linear(g, "m3.colbert", x, heads.colbert_weight, heads.colbert_bias)
    c = g.op("Mul", [c, g.op("Unsqueeze", [token_keep, "m3.axis2"], "m3.token_keep3")], "m3.colbert_masked")
    norm = g.op("ReduceL2", [c], "m3.colbert_norm", axes=[2], keepdims=1)
    norm = g.op(
        "Max", [norm, g.const("m3.norm_eps", np.array(NORM_EPSILON, np.float32))], "m3.colbert_norm_clamped"
    )
    g.op("Div", [c, norm], "token_embeddings")
