"""``int8-mixed``: INT8 where it can pass, FP32 where a layer is measured to be sensitive.

ONNX Runtime's ``int8`` candidate keeps in FP32 the nodes that damage the calibration sentences
most, but calibration holds clean sentences only, so on them everything INT8 meets the targets and
nothing stays FP32; the gate's odd rows (punctuation, emoji, one word) then miss it (minilm on AMD
Zen 4: min cosine 0.95 on punctuation). This candidate chooses on rows that include odd rows:

1. Tuning rows: the first ``Options.search_rows`` calibration sentences and ``texts/tuning.txt``
   (the held-out file's kinds of row, other texts), less any row whose model input equals a
   held-out row's. The gate's held-out rows are never among them, so its figures are on rows the
   choice never saw.
2. Everything INT8 is tried first; if it misses the tightened targets (``Thresholds.tightened``)
   on the tuning rows, each weight GEMM is quantised alone and its damage (the worst tuning row's
   1 - cosine, or abs error) measured, and the worst go back to FP32 one at a time until the rest
   meets the targets. Bounded: at most 2 x GEMMs + 1 quantise-and-run passes over ~100 rows
   (minilm: 24 GEMMs, 30 passes, 161 s of wall time on a shared, busy Zen 4 core). Per GEMM, not per layer
   part: measured on minilm, only the second FFN GEMM of layers 0-4 is sensitive (its input is
   GELU's output), so per-layer groups (attention / FFN) kept both FFN GEMMs of those layers FP32:
   14 of 24 GEMMs INT8 instead of 19, and slower (docs/engines.md). The report names each GEMM
   kept FP32 with its layer and part (``group_of``).

The INT8 form is the ``int8`` candidate's (``int8.py`` ``row_int8``: each row's own activation scale,
INT8 weights per output channel, SmoothQuant folded first), so a row's answer does not depend on
its batch-mates. ONNX Runtime's ``quantize_dynamic`` would with the same exclusions, but its one
scale per batch tensor fails the batch-independence figure (thresholds.SCALES).
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import onnx

from batchgate.gateway.models.optimize.files import quiet, save_model
from batchgate.gateway.models.optimize.int8 import INT8_OPS, named_nodes, row_int8, smooth, weight_type
from batchgate.gateway.models.optimize.options import Log, OptimizeError, Options, model_spec
from batchgate.gateway.models.optimize.rows import (
    Rows,
    TEXTS,
    _digest,
    _is_token_model,
    _token_rows,
    model_rows,
    read_kinded_texts,
)
from batchgate.gateway.models.optimize.sessions import run_rows, session

# by name: the package's ``gate`` is the verdict function, which hides the module
from batchgate.gateway.models.optimize.gate import accuracy, by_kind, judge, without_per_row, worst_harm

VARIANT = "int8-mixed"
TUNING_TEXTS = TEXTS / "tuning.txt"
# "layer.3", "layers_3", "layer3", "h.3", "block.3": the index of an encoder layer in a node's name.
_LAYER = re.compile(r"(?:^|[^a-z])(?:layers?|h|blocks?)[._/]?(\d+)(?:[^0-9]|$)", re.IGNORECASE)
_ATTENTION = re.compile(r"attn|attention|query|key|value|[qkvo]_proj", re.IGNORECASE)


def group_of(node_name: str) -> str:
    """``layer3.attention`` or ``layer3.ffn`` for a GEMM inside numbered layer 3; the node's own
    name otherwise (a pooler or head is measured alone)."""
    m = _LAYER.search(node_name)
    if m is None:
        return node_name
    part = "attention" if _ATTENTION.search(node_name) else "ffn"
    return f"layer{int(m.group(1))}.{part}"


def tuning_rows(spec, calib: Rows, search_rows: int, held: Rows, path: Path = TUNING_TEXTS) -> Rows:
    """The first ``search_rows`` calibration rows and the tuning file's odd rows (token models),
    or the calibration rows alone (models without text: their synthetic rows have no odd kinds);
    any row whose model input equals a held-out row's is left out (other texts can be the same
    token ids: a lone emoji is [UNK] alone in a WordPiece vocabulary), so the choice never sees a
    row the gate judges."""
    feeds = list(calib.feeds[: max(1, search_rows)])
    kinds = ["calibration"] * len(feeds)
    source = f"{calib.source} (first {len(feeds)})"
    if _is_token_model(spec):
        texts, tk = read_kinded_texts(path)
        feeds += _token_rows(spec, texts)
        kinds += tk
        source += f" + gateway/models/texts/{path.name} ({len(texts)} rows)"
    judged = {_digest([f]) for f in held.feeds}
    keep = [i for i, f in enumerate(feeds) if _digest([f]) not in judged]
    if len(keep) < len(feeds):
        source += f", less {len(feeds) - len(keep)} the same as held-out rows"
    feeds, kinds = [feeds[i] for i in keep], [kinds[i] for i in keep]
    if not feeds:
        raise OptimizeError(
            "every tuning row is also a held-out row; the choice needs rows the gate never sees"
        )
    return Rows(feeds, source, _digest(feeds), kinds)


def build_int8_mixed(src: Path, dst: Path, calib: Rows, opts: Options, log: Log) -> dict:
    """Build the candidate of ``src`` (``<model>/<version>/model.onnx``) into ``dst``; what the
    build did (the report's ``build``)."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if opts.scales != "row":
        raise OptimizeError(
            f"{VARIANT} builds row scales only (each row's own, batch-independent); got --scales {opts.scales}"
        )
    started = time.perf_counter()
    spec = model_spec(src.parent.parent, src.parent.name)  # its tokenizer turns the tuning texts into rows
    wtype = weight_type(opts.weights)
    held = model_rows(spec, "heldout", opts.heldout)
    tune = tuning_rows(spec, calib, opts.search_rows, held)
    with tempfile.TemporaryDirectory(prefix="batchgate-int8-mixed-") as tmp_dir:
        tmp = Path(tmp_dir)
        pre = tmp / "pre.onnx"
        with quiet():
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        model = named_nodes(onnx.load(str(pre)))
        smoothed = smooth(model, calib.feeds, opts.smooth) if opts.smooth > 0 else 0
        onnx.save(model, str(pre))
        init = {i.name for i in model.graph.initializer}
        weights = [n.name for n in model.graph.node
                   if n.op_type in INT8_OPS and len(n.input) > 1 and n.input[1] in init]  # fmt: skip
        if not weights:
            raise OptimizeError(f"{src}: no {' or '.join(INT8_OPS)} node with a constant weight to quantise")
        log(
            f"{VARIANT}: {len(weights)} weight GEMMs; tuning on {len(tune)} rows ({tune.source}), never the gate's"
        )
        ref = run_rows(session(pre), tune.feeds)
        targets = opts.thresholds.tightened()
        trial = tmp / "trial.onnx"

        def measure(names: set[str]) -> dict:
            """Accuracy on the tuning rows with the GEMMs in ``names`` INT8, the rest FP32."""
            m = onnx.load(str(pre))
            row_int8(m, names, opts.per_channel, wtype)
            onnx.save(m, str(trial))
            return accuracy(ref, run_rows(session(trial), tune.feeds))

        fp32: list[str] = []
        damage: dict[str, float] = {}
        acc = measure(set(weights))
        fails = judge(acc, targets)
        log(f"{VARIANT}: everything INT8 on the tuning rows: {fails[0] if fails else 'meets the targets'}")
        # The original against itself is the best any mix can do: when even that misses the targets
        # (a threshold past 1), every GEMM stays FP32 without a scan, and the gate refuses the result.
        beyond = judge(accuracy(ref, ref), targets) if fails else []
        if beyond:
            log(
                f"{VARIANT}: the targets are out of reach, the original against itself misses them ({beyond[0]})"
            )
            fp32 = list(weights)
        elif fails:
            for k, n in enumerate(weights, 1):
                damage[n] = worst_harm(measure({n}))
                log(f"{VARIANT}: sensitivity {k}/{len(weights)} {n} alone INT8: {damage[n]:.2e}")
            for n in sorted(weights, key=lambda n: (-damage[n], n)):
                fp32.append(n)
                if len(fp32) == len(weights):
                    break
                acc = measure(set(weights) - set(fp32))
                fails = judge(acc, targets)
                log(
                    f"{VARIANT}: {len(fp32)} GEMM(s) FP32 (last {n}): {fails[0] if fails else 'meets the targets'}"
                )
                if not fails:
                    break
        m = onnx.load(str(pre))
        done = row_int8(m, set(weights) - set(fp32), opts.per_channel, wtype)
        save_model(m, dst)
    seconds = time.perf_counter() - started
    log(f"{VARIANT}: {len(fp32)} of {len(weights)} weight GEMMs FP32, {done} INT8 ({seconds:.0f} s)")
    info = {
        "scales": "row",
        "activations": "int8 per row (each row's own scale, at run time)",
        "weights": f"{wtype if wtype == 'int8' else 'uint8 around 128'} per {'channel' if opts.per_channel else 'tensor'}",
        "weight_type": wtype,
        "per_channel": opts.per_channel,
        "smooth_alpha": opts.smooth or None,
        "smoothed_activations": smoothed,
        "quantisable_nodes": len(weights),
        "int8_nodes": done,
        "fp32_nodes": [{"node": n, "group": group_of(n), "damage_alone": damage.get(n)} for n in fp32],
        "damage_alone": dict(sorted(damage.items(), key=lambda kv: -kv[1])),
        "tuning": {"source": tune.source, "rows": len(tune), "sha256": tune.digest},
        "tuning_accuracy": without_per_row(acc),
        "tuning_accuracy_by_kind": by_kind(acc, tune.kinds),
        "search_seconds": round(seconds, 1),
    }
    if done == 0:
        info["nothing_quantised"] = True
        log(f"{VARIANT}: no GEMM stays INT8 within the targets")
    return info
