"""``batchgate optimize``: engine variants beside a model's original, each behind an accuracy gate.

A variant is built offline into the version folder of the model it came from
(``<model>/<version>/model.<variant>.onnx``) with its evaluation report beside it
(``model.<variant>.report.json`` / ``.md`` / ``.png``):

* ``optimized``: ONNX Runtime's transformer optimiser (``onnxruntime.transformers.optimizer``),
  FP32; the report lists the fusions that happened.
* ``int8``: INT8 weights (per output channel) and INT8 activations, in one of two forms:

  - ``row`` scales (the default): each activation row (a token) gets its own scale at run time,
    max|row| / 127, so a row's answer never depends on its batch-mates or its padding, and no
    calibration of ranges is needed (``row_int8``). ONNX Runtime's own dynamic quantisation
    (``dynamic``) is built only to be refused: it computes one scale over the whole batch tensor, so
    a text would get another vector beside a long or odd neighbour (measured: cosine 0.991 to itself
    alone, docs/engines.md), the result cache would keep whichever came first, and the gate's batch
    figure says so.
  - ``static`` scales: QDQ (``onnxruntime.quantization.quantize_static``), UINT8 activations with
    ranges calibrated once on calibration inputs (percentile by default, entropy or min/max).

  Both first fold SmoothQuant into the weights (outlier channels scaled down) and keep the nodes
  that damage the answer most in FP32. Which nodes those are is measured, not listed: each
  quantisable node is quantised alone and its damage to the output on the calibration inputs
  measured; then the worst are kept in FP32, one at a time, until the whole model meets the
  accuracy targets on the calibration inputs.
* ``fp16``: ``onnxruntime.transformers.float16`` with FP32 inputs and outputs kept; op types whose
  FP16 kernels ONNX Runtime lacks, or whose FP16 form misses the targets on the calibration inputs,
  stay FP32 (measured, one type at a time). Built and checked for accuracy here; its speed is a
  GPU's question (ORT runs FP16 graphs on a CPU slowly).

The gate: on a held-out set that calibration never saw (``texts/heldout.txt`` for text models,
other seeds for synthetic inputs), in one run, the variant against the original: accuracy
(embeddings: cosine per row, min and mean, nearest-neighbour agreement; scores: max abs/rel error,
pairwise rank agreement), batch independence (a row alone and padded into a batch of other
lengths), p50/p99 latency and rows/s on one pinned core, and the RSS of each loaded engine. A
variant that misses a threshold is not written (``force`` writes it, its report marked failed,
and the repository refuses to serve it). Same inputs give the same model bytes.

One module per concern, the arrows running down this list:

options.py     the variants, ``Options``, ``OptimizeError``; the model version, checked
rows.py        calibration and held-out rows (shipped texts, a user's .txt/.npz, synthetic)
sessions.py    sessions as a worker makes them; rows run through one
gate.py        accuracy, batch independence and the thresholds' verdict
timing.py      latency, rows/s and RSS on one pinned core; the machine that measured
int8.py        the INT8 graph rewrites (SmoothQuant, per-row scales)
files.py       ORT's tools kept quiet; a model written in place
mixed.py       int8-mixed: INT8 with the GEMMs measured sensitive on tuning rows kept FP32
candidates.py  building each variant (the FP32 fallback of damaging nodes measured here)
report.py      each candidate's report and --auto's table; a passed file put in place
single.py      ``optimize``: one named variant, end to end
serving.py     what a model serves now; ``set_variant``
auto.py        ``optimize_auto``: every candidate this host builds, and the choice

Only the CLI (and gateway/selection.py, which the CLI runs in a child), the tests, benches and lab
import this package; the names below are its door.
"""

from batchgate.gateway.models.optimize.auto import (  # noqa: F401
    AUTO_CANDIDATES,
    AutoResult,
    auto_candidates,
    not_slower,
    optimize_auto,
)
from batchgate.gateway.models.optimize.candidates import (  # noqa: F401
    build_fp16,
    build_int8,
    build_openvino_int8,
    build_optimized,
    build_variant,
)
from batchgate.gateway.models.optimize.gate import (  # noqa: F401
    accuracy,
    batch_bound,
    batch_independence,
    by_kind,
    gate_variant,
    judge,
    output_kind,
)
from batchgate.gateway.models.optimize.int8 import INT8_OPS, WEIGHT_TYPES, row_int8, smooth, weight_type  # noqa: F401
from batchgate.gateway.models.optimize.options import VARIANTS, Log, OptimizeError, Options  # noqa: F401
from batchgate.gateway.models.optimize.report import auto_markdown, markdown, plot, write_report  # noqa: F401
from batchgate.gateway.models.optimize.rows import (  # noqa: F401
    CALIBRATION_TEXTS,
    HELDOUT_TEXTS,
    Rows,
    model_rows,
    pad_batch,
    read_kinded_texts,
    read_texts,
)
from batchgate.gateway.models.optimize.serving import set_variant  # noqa: F401
from batchgate.gateway.models.optimize.sessions import engine_precision, engine_session, run_rows, session  # noqa: F401
from batchgate.gateway.models.optimize.single import Result, optimize  # noqa: F401
from batchgate.gateway.models.optimize.timing import BATCH_SIZES, engine_rss, machine, speed  # noqa: F401
from batchgate.gateway.models.thresholds import NN_TIE, Thresholds  # noqa: F401
