"""Building each candidate variant: ``optimized`` (ONNX Runtime's transformer fusions), ``int8`` (row,
dynamic or static scales; the nodes that damage the answer most kept in FP32, by measurement on the
calibration rows), ``fp16`` and ``openvino-int8`` (NNCF). OpenVINO's FP32 and BF16 build nothing:
they run the original file."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import tempfile
import time
from dataclasses import replace as dataclass_replace
from pathlib import Path

import onnx

from batchgate.gateway.models.optimize.files import quiet, save_model
from batchgate.gateway.models.optimize.gate import (
    accuracy,
    batch_independence,
    judge,
    without_per_row,
    worst_harm,
)
from batchgate.gateway.models.optimize.int8 import (
    INT8_OPS,
    RowReader,
    named_nodes,
    row_int8,
    smooth,
    weight_type,
)
from batchgate.gateway.models.optimize.mixed import build_int8_mixed
from batchgate.gateway.models.optimize.options import Log, OptimizeError, Options
from batchgate.gateway.models.optimize.rows import Rows
from batchgate.gateway.models.optimize.sessions import engine_precision, run_rows, session
from batchgate.gateway.repository import SAME_FILE_VARIANTS


# Op types whose FP16 form is tried in FP32 when the FP16 model misses the targets.
FP16_CANDIDATES = (
    "LayerNormalization", "Softmax", "ReduceL2", "ReduceSum", "ReduceMean", "Div", "Pow", "Sqrt",
    "Erf", "Exp", "Sigmoid", "Sub", "Add", "Mul", "MatMul", "Gemm",
)  # fmt: skip


def build_variant(
    src: Path, variant: str, tmp_dst: Path, calib: Rows, opts: Options, log: Log
) -> tuple[Path, dict]:
    """Build ``variant`` of ``src`` into ``tmp_dst``; (the file that runs, what the build did).
    OpenVINO's FP32 and BF16 build nothing: they run ``src`` itself."""
    if variant in SAME_FILE_VARIANTS:
        engine, precision = engine_precision(variant)
        from batchgate.workers import openvino_engine

        log(f"{variant}: nothing to build; OpenVINO {openvino_engine.version()} runs {src.name} in "
            f"{precision.upper()}")  # fmt: skip
        return src, {"openvino": openvino_engine.version(), "compute_precision": precision}
    if variant == "optimized":
        build = build_optimized(src, tmp_dst, log)
    elif variant == "int8":
        build = build_int8(src, tmp_dst, calib, dataclass_replace(opts, variant=variant), log)
    elif variant == "openvino-int8":
        build = build_openvino_int8(src, tmp_dst, calib, opts, log)
    elif variant == "int8-mixed":
        build = build_int8_mixed(src, tmp_dst, calib, dataclass_replace(opts, variant=variant), log)
    else:
        build = build_fp16(src, tmp_dst, calib, opts, log)
    return tmp_dst, build


def build_optimized(src: Path, dst: Path, log: Log) -> dict:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    log("optimized: ONNX Runtime transformer fusions (onnxruntime.transformers.optimizer, model_type bert)")
    # The SkipLayerNormalization fusions are left out, as CPU sessions leave them out
    # (workers/sessions.py): that CPU kernel is slower than the ops it replaces.
    fusion = FusionOptions("bert")
    fusion.enable_skip_layer_norm = fusion.enable_bias_skip_layer_norm = False
    with quiet():
        # opt_level 0: the transformer fusions only; ORT's own graph passes still run at load.
        opt = optimize_model(str(src), model_type="bert", num_heads=0, hidden_size=0, opt_level=0,
                             optimization_options=fusion)  # fmt: skip
    fusions = {k: int(v) for k, v in sorted(opt.get_fused_operator_statistics().items()) if v}
    save_model(opt.model, dst)
    log(f"optimized: fusions {fusions or 'none (no known pattern in this graph)'}")
    return {"fusions": fusions}


def build_int8(src: Path, dst: Path, calib: Rows, opts: Options, log: Log) -> dict:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    wtype = weight_type(opts.weights)
    method = {"percentile": CalibrationMethod.Percentile, "entropy": CalibrationMethod.Entropy,
              "minmax": CalibrationMethod.MinMax}[opts.method]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="batchgate-int8-") as tmp_dir:
        tmp = Path(tmp_dir)
        pre = tmp / "pre.onnx"
        log("int8: pre-processing (ONNX Runtime's quant_pre_process: constant folding, shape inference)")
        with quiet():
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        model = named_nodes(onnx.load(str(pre)))
        smoothed = 0
        if opts.smooth > 0:
            log(f"int8: smoothing activation outliers into the weights (SmoothQuant, alpha {opts.smooth:g})")
            smoothed = smooth(model, calib.feeds, opts.smooth)
        onnx.save(model, str(pre))
        init = {i.name for i in model.graph.initializer}
        candidates = [n.name for n in model.graph.node if n.op_type in INT8_OPS]
        if opts.smooth < 0 or opts.smooth > 1:
            raise OptimizeError(f"smooth (SmoothQuant's alpha) must be in [0, 1], got {opts.smooth}")
        if not candidates:
            raise OptimizeError(f"{src}: no {' or '.join(INT8_OPS)} node to quantise")
        weights = [
            n.name for n in model.graph.node if n.op_type in INT8_OPS and any(x in init for x in n.input[1:2])
        ]
        cache = tmp / "ranges.json"
        extra = {"CalibStridedMinMax": 1, "CalibPercentile": opts.percentile, "ActivationSymmetric": False,
                 "WeightSymmetric": True}  # fmt: skip

        if opts.scales in ("row", "dynamic"):
            # Activation x activation products (attention's) have no weight to quantise ahead.
            candidates = weights
            if not candidates:
                raise OptimizeError(
                    f"{src}: no {' or '.join(INT8_OPS)} node with a constant 2-D weight to quantise"
                )
        if opts.scales == "row":

            def quantize(out: Path, include: list[str] | None, exclude: list[str]) -> None:
                m = onnx.load(str(pre))
                row_int8(
                    m,
                    set(include if include is not None else candidates) - set(exclude),
                    opts.per_channel,
                    wtype,
                )
                onnx.save(m, str(out))

            log(f"int8: each row's own activation scale (at run time); {len(candidates)} weight GEMMs")
        elif opts.scales == "dynamic":
            # Built so the gate can be seen refusing it (thresholds.SCALES says why).

            def quantize(out: Path, include: list[str] | None, exclude: list[str]) -> None:
                with quiet():
                    quantize_dynamic(
                        str(pre), str(out), per_channel=opts.per_channel,
                        weight_type=QuantType.QUInt8 if wtype == "uint8" else QuantType.QInt8,
                        op_types_to_quantize=list(INT8_OPS), nodes_to_quantize=include, nodes_to_exclude=exclude,
                    )  # fmt: skip

            log(f"int8: ONNX Runtime's dynamic scales (one per batch tensor); {len(candidates)} weight GEMMs")
        else:

            def quantize(out: Path, include: list[str] | None, exclude: list[str]) -> None:
                with quiet():
                    quantize_static(
                        str(pre), str(out), RowReader(calib.feeds), quant_format=QuantFormat.QDQ,
                        per_channel=opts.per_channel, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QUInt8 if wtype == "uint8" else QuantType.QInt8,
                        calibrate_method=method,
                        op_types_to_quantize=list(INT8_OPS), nodes_to_quantize=include,
                        nodes_to_exclude=exclude, calibration_cache_path=str(cache), extra_options=extra,
                    )  # fmt: skip

            log(f"int8: calibrating activation ranges ({opts.method}"
                f"{f' p{opts.percentile:g}' if opts.method == 'percentile' else ''}) on {len(calib)} rows, one at a time")  # fmt: skip
        if opts.weights == "auto":
            why = {"uint8": "this CPU has no VNNI: ORT's UINT8 x INT8 kernel saturates, UINT8 x UINT8 is exact",
                   "int8": "this CPU multiplies UINT8 x INT8 exactly"}[wtype]  # fmt: skip
            log(f"int8: weights stored as {wtype} ({why})")
        t0 = time.perf_counter()
        trial = tmp / "trial.onnx"
        quantize(trial, None, [])
        log(f"int8: quantised in {time.perf_counter() - t0:.1f} s; {len(candidates)} quantisable nodes")
        ref_sess = session(pre)
        search = calib.feeds[: max(1, opts.search_rows)]
        ref_search = run_rows(ref_sess, search)
        ref_all = run_rows(ref_sess, calib.feeds)
        targets = opts.thresholds.tightened()
        static = opts.scales == "static"
        info: dict = {"scales": opts.scales, "method": opts.method if static else None,
                      "percentile": opts.percentile if static and opts.method == "percentile" else None,
                      "per_channel": opts.per_channel,
                      "activations": "uint8 per tensor (static)" if static else
                                     "uint8 per batch tensor (one scale for the whole batch, at run time)" if opts.scales == "dynamic" else
                                     "int8 per row (each row's own scale, at run time)",
                      "weights": f"{wtype if wtype == 'int8' else 'uint8 around 128'} per {'channel' if opts.per_channel else 'tensor'}",
                      "weight_type": wtype,
                      "quantisable_nodes": len(candidates), "fallback": opts.fallback,
                      "smooth_alpha": opts.smooth or None, "smoothed_activations": smoothed}  # fmt: skip
        excluded: list[str] = []
        damage: dict[str, float] = {}
        if opts.fallback:
            acc = accuracy(ref_all, run_rows(session(trial), calib.feeds))
            fails = judge(acc, targets)
            # The original against itself is the best any node set can do: when even that misses
            # (a target such as --min-cosine 1.5), no scan can pass, and each of its steps costs a
            # quantisation and a run over the calibration rows.
            beyond = judge(accuracy(ref_all, ref_all), targets) if fails else []
            if beyond:
                log(
                    f"int8: the targets are out of reach, the original against itself misses them ({beyond[0]})"
                )
                excluded = list(candidates)
            elif fails:
                log(
                    f"int8: everything quantised misses the calibration targets ({fails[0]}); measuring each node"
                )
                for k, name in enumerate(candidates, 1):
                    quantize(trial, [name], [])
                    damage[name] = worst_harm(accuracy(ref_search, run_rows(session(trial), search)))
                    log(f"int8: sensitivity {k}/{len(candidates)} {name}: {damage[name]:.2e}")
                order = sorted(candidates, key=lambda n: (-damage[n], n))
                for name in order:
                    excluded.append(name)
                    if len(excluded) == len(candidates):
                        break
                    quantize(trial, None, excluded)
                    acc = accuracy(ref_all, run_rows(session(trial), calib.feeds))
                    fails = judge(acc, targets)
                    log(f"int8: {len(excluded)} node(s) kept in FP32 (last {name}): "
                        f"{'meets the calibration targets' if not fails else fails[0]}")  # fmt: skip
                    if not fails:
                        break
            info["calibration_accuracy"] = without_per_row(acc)
        info["fp32_nodes"] = [{"node": n, "damage_alone": damage.get(n)} for n in excluded]
        info["int8_nodes"] = len(candidates) - len(excluded)
        info["int8_weight_nodes"] = len([n for n in weights if n not in excluded])
        info["damage_alone"] = dict(sorted(damage.items(), key=lambda kv: -kv[1])) if damage else {}
        if len(excluded) == len(candidates):
            info["nothing_quantised"] = True
            log("int8: no node stays INT8 within the targets")
        quantize(trial, None, excluded)
        save_model(onnx.load(str(trial)), dst)
    return info


def build_fp16(src: Path, dst: Path, calib: Rows, opts: Options, log: Log) -> dict:
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    original = onnx.load(str(src))
    present = {n.op_type for n in original.graph.node}
    blocked: list[str] = []
    unsupported: list[str] = []

    def convert() -> onnx.ModelProto:
        with quiet():
            return convert_float_to_float16(copy.deepcopy(original), keep_io_types=True,
                                            op_block_list=list(DEFAULT_OP_BLOCK_LIST) + blocked + unsupported)  # fmt: skip

    def loadable(model: onnx.ModelProto, path: Path):
        """A session on ``model``; op types ORT has no FP16 CPU kernel for go back to FP32."""
        while True:
            save_model(model, path)
            try:
                return session(path)
            except Exception as exc:  # NOT_IMPLEMENTED: "Could not find an implementation for Op(13) ..."
                m = re.search(r"implementation for (\w+)\(", str(exc))
                if not m or m.group(1) in unsupported:
                    raise
                unsupported.append(m.group(1))
                log(f"fp16: ONNX Runtime has no FP16 CPU kernel for {m.group(1)}; it stays FP32")
                model = convert()

    log("fp16: converting (onnxruntime.transformers.float16, FP32 inputs and outputs kept)")
    ref = run_rows(session(src), calib.feeds[: max(1, opts.search_rows)])
    search = calib.feeds[: max(1, opts.search_rows)]
    targets = opts.thresholds.tightened()
    trial = dst.with_name(f".{dst.name}.trial")
    try:

        def measure() -> tuple[dict, list[str], float]:
            sess = loadable(convert(), trial)
            got = run_rows(sess, search)
            a = accuracy(ref, got)
            f = judge(a, targets)
            bi = batch_independence(sess, search, got)
            if bi > targets.batch_tolerance:
                f.append(f"batch_independence {bi:.3g} (needs <= {targets.batch_tolerance:g})")
            return a, f, bi

        acc, fails, indep = measure()
        while fails:
            options = [op for op in FP16_CANDIDATES if op in present and op not in blocked + unsupported]
            if not options:
                break
            log(f"fp16: misses the calibration targets ({fails[0]}); trying each op type in FP32")
            best = None
            for op in options:
                blocked.append(op)
                a, f, bi = measure()
                blocked.pop()
                key = (
                    len(f),
                    bi,
                    worst_harm(a),
                )  # fewest failures, then a row's drift in a batch, then accuracy
                if best is None or key < best[1]:
                    best = (op, key)
            blocked.append(best[0])
            log(f"fp16: {best[0]} stays FP32 (then {best[1][0]} failure(s), batch drift {best[1][1]:.2e}, "
                f"damage {best[1][2]:.2e})")  # fmt: skip
            acc, fails, indep = measure()
        model = convert()
    finally:
        trial.unlink(missing_ok=True)
    save_model(model, dst)
    return {"blocked_measured": blocked, "no_fp16_kernel": unsupported, "calibration_accuracy": without_per_row(acc),
            "calibration_batch_independence": indep}  # fmt: skip


def build_openvino_int8(src: Path, dst: Path, calib: Rows, opts: Options, log: Log) -> dict:
    """NNCF's post-training quantisation (its ONNX backend: a QDQ ONNX file OpenVINO runs with INT8
    kernels), transformer preset (attention scores, softmax, LayerNorm and the like kept in the
    engine's precision; SmoothQuant on), static scales calibrated on the calibration rows."""
    try:
        import nncf
    except ImportError:
        raise OptimizeError(
            "openvino-int8 is built with NNCF, which is not installed: pip install 'batchgate[openvino-int8]'"
        ) from None
    log(
        f"openvino-int8: NNCF post-training quantisation on {len(calib)} calibration rows (transformer preset)"
    )
    # NNCF's ONNX passes read every tensor's type from value_info: infer the shapes first.
    model = onnx.shape_inference.infer_shapes(onnx.load(str(src)))
    try:
        with quiet(), contextlib.redirect_stderr(open(os.devnull, "w")):
            quantized = nncf.quantize(
                model,
                nncf.Dataset(calib.feeds),
                model_type=nncf.ModelType.TRANSFORMER,
                subset_size=len(calib),
            )
    except Exception as exc:  # NNCF's own errors carry no common type
        raise OptimizeError(
            f"NNCF {nncf.__version__} could not quantise {src.name}: {type(exc).__name__}: {exc}"
        ) from None
    save_model(quantized, dst)
    nodes = [n for n in quantized.graph.node]
    qdq = sum(n.op_type == "QuantizeLinear" for n in nodes)
    gemms = [n for n in model.graph.node if n.op_type in INT8_OPS]
    return {"nncf": nncf.__version__, "quantize_nodes": qdq, "quantisable_nodes": len(gemms),
            "compute_precision": engine_precision("openvino-int8")[1]}  # fmt: skip
