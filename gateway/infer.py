"""The one request pipeline every transport calls once the door has taken the call:
admit → decode → runtime → encode.

The transports (gateway/transport/) translate their wire format to a ``Call`` and an ``Answer``
back (gateway/call.py: plain types, no protobuf) and map ``GatewayError`` kinds to their own
status codes, each in one table. Who is calling and whether the server takes the call now is the
door's (gateway/admission/door.py, built by the server and given to the pipeline and every
transport), entered once by each transport before any body is read. Here:

- ``check_call``: client strings bounded before anything echoes or keys on them;
- ``infer``: the tenant's limits before decoding, then the runtime; one accounting wrapper (in
  flight, ok, failed, and the door's pass left as the call ends) for unary gRPC, each stream
  message and REST alike;
- ``texts``: a list of texts (OpenAI, TEI, rerank) as one call: the model looked up and checked
  once, its prompt, the text limits (the text stage's, ``TextStage.check_list``), then admission
  and the runtime's text path;
- model control (load/unload) behind ``model_control`` and the tenant file's ``admin`` flag, the
  name checked before any state is made for it;
- the metadata, statistics and repository index answers, as plain types (gateway/metadata.py)
  each transport writes in its wire form; the model's config as the repository parsed it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from importlib.metadata import PackageNotFoundError, version

import numpy as np

from batchgate.gateway import tokens, tracing
from batchgate.gateway import openai_ids, text_calls, vector_types
from batchgate.gateway.vector_types import CALIBRATED
from batchgate.gateway.call import Answer, Call, TextAnswer, TextCall
from batchgate.gateway.admission import Account, Ticket, budgets
from batchgate.gateway.admission.door import Door, Pass
from batchgate.gateway.admission.usage import UNKNOWN_MODEL, Usage, cause_of
from batchgate.gateway.scheduling.stats import COST, CallCost
from batchgate.gateway.scheduling.request import resolve as resolve_budget
from batchgate.gateway.dataplane import DataPlane, ReloadFailed
from batchgate.gateway.errors import ECHO_MAX, GatewayError, Kind, clip, invalid, not_found
from batchgate.gateway.metadata import (
    BatchStats,
    Duration,
    IndexEntry,
    InferStats,
    ModelInfo,
    ModelStats,
    ServerInfo,
    TensorInfo,
)
from batchgate.gateway.metrics import TransportCounters

log = logging.getLogger(__name__)

try:
    VERSION = version("batchgate")
except PackageNotFoundError:  # running from a source tree without an install
    VERSION = "0.0.0+source"

# The KServe/Triton extensions this server serves, exactly: model_repository is the index plus
# load/unload (those answer PERMISSION_DENIED unless model_control is on).
EXTENSIONS = ("model_repository", "model_configuration", "statistics", "binary_tensor_data")

# A model directory name: what a repository can hold and nothing that walks out of it.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")

_clock = time.perf_counter


def _too_long(what: str, text: str) -> GatewayError:
    return invalid(f"{what} '{clip(text)}' is longer than {ECHO_MAX} characters")


def check_call(call: Call) -> None:
    """Every client string that an error may echo or a label may carry, bounded before any other
    work (a length check each: a few hundred nanoseconds per call)."""
    if len(call.model) > ECHO_MAX:
        raise not_found(f"unknown model '{clip(call.model)}'")
    if len(call.version) > ECHO_MAX:
        raise not_found(f"model has no version '{clip(call.version)}'")
    for t in call.inputs:
        if len(t.name) > ECHO_MAX:
            raise _too_long("input name", t.name)
        if t.parameters:
            _check_parameters(t.parameters)
    for o in call.outputs:
        if len(o.name) > ECHO_MAX:
            raise _too_long("output name", o.name)
        if o.parameters:
            _check_parameters(o.parameters)
    if call.parameters:
        _check_parameters(call.parameters)


def _check_parameters(params: dict) -> None:
    for key, value in params.items():
        if len(key) > ECHO_MAX:
            raise _too_long("parameter name", key)
        if isinstance(value, str) and len(value) > ECHO_MAX:
            raise invalid(f"parameter '{key}' is {len(value)} characters; at most {ECHO_MAX} are accepted")


def apply_prompt(rt, arrays: dict, parameters) -> dict:
    """Each text with the call's prompt before it, exactly as if the caller had prefixed it: the
    cache key, the length bucket and the vector all follow the prefixed text."""
    name = parameters.get("prompt_name")
    if name is not None and not isinstance(name, str):
        raise invalid("parameter 'prompt_name' must be a string: the name of one of the model's prompts")
    prompt = text_calls.prompt_of(rt.spec, name)
    if not prompt:
        return arrays
    head = prompt.encode()
    column = arrays[rt.text.input]
    out = np.empty(column.shape, dtype=object)
    flat, dst = column.reshape(-1), out.reshape(-1)
    for i, b in enumerate(flat):
        dst[i] = head + b if isinstance(b, bytes) else b  # (not bytes: the text stage refuses it by name)
    return {**arrays, rt.text.input: out}


async def _cut_left(stage, texts, long, encodings, left, given) -> tuple[list | None, str]:
    """The call's encodings with the rows made elsewhere put in: token ids or pairs given
    (``given``), and with ``left`` the texts that may be over the model's length (``long``)
    tokenised keeping their last tokens; and the cache tag of those ("left", or "" when none)."""
    if given is None and not (left and long):
        return encodings, ""
    out = list(encodings) if encodings is not None else [None] * len(texts)
    if given is not None:
        for i, e in enumerate(given):
            if e is not None:
                out[i] = e
    if not (left and long):
        return out, ""
    todo = [i for i in long if given is None or given[i] is None]
    made = await asyncio.to_thread(tokens.encode_left, stage, [texts[i] for i in todo])
    for i, e in zip(todo, made, strict=True):
        out[i] = e
    return out, "left"


class Pipeline:
    """What a call goes through, whichever transport it came on, once the door has taken it."""

    def __init__(self, plane: DataPlane, door: Door, usage: Usage | None = None) -> None:
        self.plane = plane
        self.door = door  # built by the server, which gives the same door to every transport
        self.admission = door.admission
        self.settings = plane.settings
        self.inflight = 0  # calls inside ``infer`` and ``texts``, all transports (the shedder's ``Load``)
        self.usage = usage  # what each tenant used (None: usage_metering off, nothing counted)
        # int8/uint8 vector ranges per (model, version, file): calibrated on first use
        self._ranges: dict[tuple, vector_types.Ranges] = {}
        self._ranges_locks: dict[tuple, asyncio.Lock] = {}
        if self.settings.openai_token_ids == "openai":
            # the package is found at start (a missing one fails the start, not a call); its
            # table is read on the first token-id call (about 0.1 s, 10 MB)
            openai_ids.data_file()

    @property
    def lag(self):
        """The event loop's lag monitor (the shedder's ``Load``)."""
        return self.plane.lag

    def backlog_s(self) -> float | None:
        """The work queued ahead of a new call, in seconds (the shedder's ``Load``)."""
        return self.plane.backlog_s()

    @property
    def open(self) -> bool:
        return self.admission.open

    def identify(self, metadata) -> Account | None:
        return self.door.identify(metadata)

    # -- inference ------------------------------------------------------------------------------

    async def infer(self, call: Call, pass_: Pass, edge: TransportCounters) -> Answer:
        """The call the door took as ``pass_``, counted at ``edge`` and at the door (``_counted``).
        Raises ``GatewayError`` for everything the client should hear about; other exceptions are bugs."""
        return await self._counted(pass_, edge, call.model, call.version, self._infer(call, pass_))

    async def _counted(self, pass_: Pass, edge: TransportCounters, model: str, version: str, work) -> Answer:
        """One accounting wrapper for every call: in flight, then ok or failed with its outcome at
        ``edge``; the pass is left here, as the call ends (its transport's own exit is then a no-op)."""
        t0 = _clock()
        edge.inflight += 1
        self.inflight += 1
        span = tracing.begin_call(model, pass_, edge.name) if tracing.TRACER is not None else None
        usage = self.usage
        if usage is not None:
            cost = CallCost()
            reset = COST.set(cost)  # the scheduler adds the call's rows computed and compute time
        with pass_:
            try:
                answer = await work
            except BaseException as exc:
                if usage is not None:
                    self._refused(usage, pass_, model, exc)
                edge.failed(model, version, exc)
                if span is not None:
                    tracing.end_call(span, exc)
                raise
            finally:
                if usage is not None:
                    COST.reset(reset)
                edge.inflight -= 1
                self.inflight -= 1
        if usage is not None:
            caller, tokens = pass_.caller, answer.tokens
            usage.answered(
                caller.tenant.name if caller is not None else "anonymous", answer.model, cost.rows,
                sum(tokens) if tokens else 0, cost,
            )  # fmt: skip
        edge.ok(answer.model, answer.version, _clock() - t0)
        if span is not None:
            tracing.end_call(span)
        return answer

    def _refused(self, usage: Usage, pass_: Pass, model: str, exc: BaseException) -> None:
        caller = pass_.caller
        usage.refused(
            caller.tenant.name if caller is not None else "anonymous",
            model if model in self.plane.models else UNKNOWN_MODEL,  # a label never holds client text
            cause_of(exc),
        )

    async def _infer(self, call: Call, pass_: Pass) -> Answer:
        check_call(call)
        plane = self.plane
        if plane.draining:
            plane.last_refused = time.monotonic()
        rt = plane.get(call.model, call.version)
        caller = pass_.caller
        if caller is None:
            return await self._run(rt, call, pass_.time_left, None, None)
        tenant = caller.tenant
        # Admission runs before any decoding: the row count is read off the first input's shape.
        rows = call.rows if rt.spec.batched else 1
        ticket = await self._admit(pass_, call.model, rows)
        try:
            # The runtime is looked up again: a reload may have swapped it during a Redis decision.
            rt = plane.get(call.model, call.version)
            return await self._run(rt, call, pass_.time_left, tenant.default_class, tenant.cache_namespace)
        finally:
            ticket.release()

    async def _admit(self, pass_: Pass, model: str, rows: int, tokens: int = 0) -> Ticket:
        if tracing.TRACER is None:
            return await self.door.admit(pass_, model, rows, tokens)
        with tracing.TRACER.start_as_current_span("admission", attributes={"batchgate.rows": rows}):
            return await self.door.admit(pass_, model, rows, tokens)

    def _budget(self, rt, parameters: dict, time_left: float | None, default_class: str | None, rows=1):
        plane = self.plane
        return resolve_budget(
            parameters, time_left, rt.scheduler.clock(), plane.classes,
            default_class or plane.settings.default_latency_class, rt.schedule,
            rows if rt.spec.batched else 1, None if default_class else plane.batch_class,
        )  # fmt: skip

    async def _run(self, rt, call: Call, time_left, default_class, namespace) -> Answer:
        budget = self._budget(rt, call.parameters, time_left, default_class, call.rows)
        codec = rt.codec
        wanted = codec.requested(call)
        arrays, rows = codec.decode(call)
        if (cost := COST.get()) is not None:
            cost.rows = rows
        if rt.text is not None and (rt.spec.params.prompts or "prompt_name" in call.parameters):
            arrays = apply_prompt(rt, arrays, call.parameters)
        outputs = await rt.infer(arrays, rows, budget, wanted=wanted, namespace=namespace)
        if tracing.TRACER is None:
            return codec.encode(call, outputs, wanted)
        with tracing.TRACER.start_as_current_span("response"):
            return codec.encode(call, outputs, wanted)

    def text_kinds(self) -> dict[str, str]:
        """Served text models -> their kind, by name."""
        return text_calls.text_models(self.plane)

    async def texts(self, pass_: Pass, edge: TransportCounters, call: TextCall) -> TextAnswer:
        """A text call (gateway/call.py ``TextCall``, from any text wire) as one call: through the
        door once (``pass_``), the model looked up and every decision about the call made once
        (gateway/text_calls.py), admitted once against the tenant's limits for all its rows, each
        text tokenised once, its rows queued by length bucket to batch with other callers' texts,
        and the answer shaped as the call asked (cut, normalised, scores, quantised forms).
        Raises ``GatewayError`` naming the field it concerns."""
        model = call.model
        if model is None:
            model = text_calls.default_model(self.plane, self.settings, call.output)
        return await self._counted(pass_, edge, model, "", self._texts(pass_, call, model))

    def _text_runtime(self, model: str):
        """The runtime of ``model`` (the first of the call's two lookups), refused naming ``model``
        (an unknown one without KServe's discovery: each text wire names its own)."""
        try:
            return self.plane.get(model)
        except GatewayError as exc:
            if exc.kind is Kind.NOT_FOUND:
                raise GatewayError(Kind.NOT_FOUND, f"unknown model '{clip(model)}'", field="model") from None
            exc.field = "model"
            raise

    async def _texts(self, pass_: Pass, call: TextCall, model: str) -> TextAnswer:
        rt = self._text_runtime(model)
        plan = text_calls.plan(rt, self.plane, call, model)
        stage = rt.text
        texts, given, tag = await text_calls.rows(rt, call, plan)
        texts, encodings, long = await stage.check_list(
            texts, plan.prompt, cut=plan.truncate and given is None, exact=not plan.truncate,
            left=call.left, given=given,
        )  # fmt: skip
        encodings, made = await _cut_left(stage, texts, long, encodings, call.left, given)
        tag += made
        raw = [t.encode() for t in texts]
        caller = pass_.caller
        # the estimate only where a token budget will read it (a few us a text, on the loop)
        charge = budgets.estimate(stage, raw) if caller is not None and caller.budgets_tokens(model) else 0
        ticket = await self._admit(pass_, model, len(texts), charge)
        if (cost := COST.get()) is not None:
            cost.rows = len(texts)
        try:
            # Looked up after admission: a reload may have swapped it during a Redis decision.
            rt = self.plane.get(model, "")
            tenant = caller.tenant if caller is not None else None
            rows = len(call.ids) if call.ids is not None else len(call.texts)  # as the caller sent them
            budget = self._budget(rt, call.parameters, pass_.time_left, tenant and tenant.default_class, rows)
            namespace = tenant.cache_namespace if tenant is not None else None
            if tag:  # rows made another way than by the usual tokenisation never share a cache entry
                namespace = f"{namespace or ''}/{tag}"
            array, counts = await rt.texts(raw, plan.output, budget, namespace, encodings)
        except BaseException:
            ticket.settle(0, self.admission.clock())  # nothing answered: nothing used
            raise
        finally:
            ticket.release()
        if caller is not None:
            now = self.admission.clock()
            ticket.settle(sum(counts), now)  # the budget tracks what `usage` reports
            pass_.limits = ticket.headers(now)
        ranges = None
        if any(t in CALIBRATED for t in call.types):
            ranges = await self._vector_ranges(rt, plan.output)
        return text_calls.finish(call, plan, rt, array, counts, ranges)

    async def _vector_ranges(self, rt, output: str) -> vector_types.Ranges:
        """The model's per-dimension ranges for int8/uint8 vectors: its ``vector_ranges.json``,
        else calibrated once, on the first call that asks, from the model's own vectors of the
        shipped held-out rows (run through its runtime like any call), and saved beside it."""
        spec = rt.spec
        key = (spec.name, spec.version, spec.fingerprint)
        ranges = self._ranges.get(key)
        if ranges is not None:
            return ranges
        lock = self._ranges_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._ranges:
                loop = asyncio.get_running_loop()
                # background work, not the caller's: queued as bulk where the server has that class
                bulk = "bulk" if "bulk" in self.plane.classes else None

                def embed(batch: list[str]) -> np.ndarray:
                    budget = self._budget(rt, {}, None, bulk)
                    work = rt.texts([t.encode() for t in batch], output, budget, None, None)
                    return asyncio.run_coroutine_threadsafe(work, loop).result()[0]

                sizes = spec.params.matryoshka_dimensions
                identity = {"name": spec.name, "version": spec.version, "fingerprint": spec.fingerprint}
                self._ranges[key] = await asyncio.to_thread(
                    vector_types.ensure, spec.path.parent, embed, sizes, identity, log=log.info
                )
        return self._ranges[key]

    def text_runtime(self, model: str | None):
        """A served text model's runtime for the calls that read the model rather than compute
        with it (TEI's /info, /tokenize, /decode): ``model`` or the default for ``output``."""
        if model is None:
            model = text_calls.default_model(self.plane, self.settings, None)
        rt = self._text_runtime(model)
        if rt.text is None or rt.spec.kind is None:
            raise invalid(
                f"model '{model}' does not take text; text models: {sorted(self.text_kinds())}", "model"
            )
        return rt

    def text_info(self, model: str | None) -> dict:
        """What a TEI client reads at ``/info`` (REST and gRPC) about text model ``model`` (None:
        the default model)."""
        rt = self.text_runtime(model)
        spec = rt.spec
        return text_calls.describe(
            rt, self.settings, VERSION, self._ranges.get((spec.name, spec.version, spec.fingerprint))
        )

    async def tokenize(
        self, model: str | None, texts: list[str], add_special_tokens: bool, prompt_name: str | None
    ) -> list[list[dict]]:
        """TEI's tokenize: each text's tokens (id, text, special, byte offsets) as the model sees
        it, its prompt first; held to the model's text limits, tokenised in a thread."""
        rt = self.text_runtime(model)
        if not texts:
            raise invalid("Input cannot be empty", "inputs")
        prompts = rt.spec.params.prompts
        if prompt_name is not None and prompt_name not in prompts:  # TEI's words
            listed = ", ".join(f'"{p}"' for p in sorted(prompts))
            raise invalid(
                f"Prompt name '{clip(prompt_name)}' was not found. Available prompts: [{listed}]",
                "prompt_name",
            )
        prompt = text_calls.prompt_of(rt.spec, prompt_name)
        limit = rt.text.settings.max_text_bytes
        for i, t in enumerate(texts):
            if len(t.encode()) > limit:
                raise invalid(f"inputs {i}: text is over {limit} bytes (parameter max_text_bytes)", "inputs")
        return await asyncio.to_thread(
            tokens.tokenize, rt.text, [prompt + t for t in texts], add_special_tokens
        )

    async def decode(self, model: str | None, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """TEI's decode: token-id rows back to text, each id checked against the vocabulary."""
        rt = self.text_runtime(model)
        if len(ids) > text_calls.MAX_INPUTS:
            raise invalid(f"'ids' holds {len(ids)} rows; at most {text_calls.MAX_INPUTS} per request", "ids")
        rows = tokens.ids_of(ids, "ids", tokens.vocabulary_size(rt.text))
        return await asyncio.to_thread(tokens.decode, rt.text, rows, skip_special_tokens)

    def kind_of(self, model: str | None) -> tuple[str, str]:
        """(model, its kind) for a wire that answers by the model's kind (TEI's ``POST /``): read
        off the served models, so the call it leads to still looks its model up only twice."""
        kinds = self.text_kinds()
        if model is None:
            model = text_calls.default_model(self.plane, self.settings, None)
        kind = kinds.get(model)
        if kind is None:
            self._text_runtime(model)  # the refusal a lookup gives: unknown, unavailable, ...
            raise invalid(f"model '{clip(model)}' does not take text; text models: {sorted(kinds)}", "model")
        return model, kind

    # -- model control --------------------------------------------------------------------------

    def _may_control(self, caller: Account | None) -> None:
        if not self.settings.model_control:
            raise GatewayError(
                Kind.PERMISSION,
                "model control is off on this server: load/unload need model_control "
                "(BATCHGATE_MODEL_CONTROL=true), and with a tenant file a tenant marked admin",
            )
        if caller is not None and not caller.tenant.admin:
            raise GatewayError(
                Kind.PERMISSION,
                f"tenant '{caller.tenant.name}' may not load or unload models "
                "(admin: true in the tenant file)",
            )

    @staticmethod
    def _check_name(name: str) -> None:
        """Before anything is created for ``name`` (a lock, a log line, a metric label)."""
        if len(name) > ECHO_MAX or not _MODEL_NAME.fullmatch(name):
            raise not_found(f"no model directory '{clip(name)}' in the repository")

    async def load(self, caller: Account | None, name: str, parameters) -> None:
        """Triton's load/reload: re-read the model's directory, start and warm it, swap it in.

        A directory that cannot be served answers FAILED_PRECONDITION with the reason (the files
        must be fixed first; the previous load keeps serving). Triton's inline overrides
        (``config`` / ``file:`` parameters) are not offered: UNIMPLEMENTED, never silently ignored."""
        self._may_control(caller)
        self._check_name(name)
        if parameters:
            keys = sorted(clip(k, 32) for k in list(parameters)[:8])
            raise GatewayError(
                Kind.UNSUPPORTED,
                f"load parameters {keys} are not supported: edit the model's directory in the repository "
                "and load it again",
            )
        try:
            await self.plane.reload(name)
        except ReloadFailed as exc:
            raise GatewayError(Kind.PRECONDITION, f"failed to load '{name}': {exc}") from None

    async def unload(self, caller: Account | None, name: str) -> None:
        """Stop serving the model once the calls it holds are answered."""
        self._may_control(caller)
        self._check_name(name)
        if name not in self.plane.models:
            raise not_found(f"model '{name}' is not loaded")
        await self.plane.unload(name)

    # -- metadata -------------------------------------------------------------------------------

    @staticmethod
    def server_metadata() -> ServerInfo:
        return ServerInfo(name="batchgate", version=VERSION, extensions=list(EXTENSIONS))

    def variant_info(self, name: str, version: str) -> dict:
        """Which engine variant serves the model and how this host's selection chose it."""
        rt = self.plane.get(name, version)
        return {"variant": rt.spec.variant, "precision": rt.spec.precision, "selection": rt.selection}

    def require(self, name: str, version: str) -> None:
        """Refuses (NOT_FOUND, UNAVAILABLE) unless the model's version serves now."""
        self.plane.get(name, version)

    def model_ready(self, name: str, version: str) -> bool:
        try:
            self.plane.get(name, version)
        except GatewayError:
            return False
        return True

    def _runtime_for_metadata(self, name: str, version: str):
        if len(name) > ECHO_MAX or len(version) > ECHO_MAX:
            raise not_found(f"unknown model '{clip(name)}'")
        if not self.plane.draining:
            return self.plane.get(name, version)
        return self.plane.runtimes(name, version)[-1]  # metadata stays readable while draining

    def model_metadata(self, name: str, version: str) -> ModelInfo:
        spec = self._runtime_for_metadata(name, version).spec
        versions = sorted(self.plane.models[spec.name], key=int)

        def meta(t):
            return TensorInfo(t.name, t.datatype, list(((-1,) + t.dims) if spec.batched else t.dims))

        return ModelInfo(
            name=spec.name,
            versions=versions,
            platform=spec.config.platform or "onnxruntime_onnx",
            inputs=[meta(t) for t in spec.inputs],
            outputs=[meta(t) for t in spec.outputs],
        )

    def model_config(self, name: str, version: str):
        """The model's config as the repository parsed it from its config.pbtxt (Triton's
        ModelConfig, the one schema both wires show)."""
        return self._runtime_for_metadata(name, version).spec.config

    def statistics(self, name: str, version: str) -> list[ModelStats]:
        if len(name) > ECHO_MAX or len(version) > ECHO_MAX:
            raise not_found(f"unknown model '{clip(name)}'")
        out = []
        for rt in self.plane.runtimes(name, version):
            st = rt.scheduler.stats
            s = InferStats(
                success=Duration(st.success_count, st.success_ns),
                fail=Duration(st.fail_count, st.fail_ns),
                queue=Duration(st.queue_count, st.queue_ns),
                compute_input=Duration(st.input_count, st.input_ns),
                compute_infer=Duration(st.infer_count, st.infer_ns),
                compute_output=Duration(st.output_count, st.output_ns),
            )
            # Triton: cache hits are in success but in none of queue/compute (gateway/result_cache.py).
            if rt.cache is not None:
                s.cache_hit, s.cache_miss = Duration(), Duration()
                rt.cache.fill_statistics(s)
            batches = []
            for size in sorted(st.by_batch_size):
                b = st.by_batch_size[size]
                batches.append(
                    BatchStats(
                        size, Duration(b.count, b.input_ns), Duration(b.count, b.infer_ns),
                        Duration(b.count, b.output_ns),
                    )
                )  # fmt: skip
            out.append(
                ModelStats(
                    name=rt.spec.name,
                    version=rt.spec.version,
                    last_inference=st.last_inference_ms,
                    inference_count=st.inference_count,
                    execution_count=st.execution_count,
                    inference_stats=s,
                    batch_stats=batches,
                )
            )
        return out

    def repository_index(self, ready: bool) -> list[IndexEntry]:
        plane = self.plane
        out = []
        for name in sorted(set(plane.models) | set(plane.failures)):
            for ver in sorted(plane.models.get(name, {}), key=int):
                out.append(IndexEntry(name, ver, "READY"))
            failure = plane.failures.get(name)
            if failure is not None and not ready:
                out.append(IndexEntry(name, failure.version, "UNAVAILABLE", failure.reason))
        return out
