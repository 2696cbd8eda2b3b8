"""OpenTelemetry traces: off by default, and then free (one module attribute read per stage).

With ``otel_endpoint`` set (an OTLP/HTTP collector, e.g. ``http://otel-collector:4318``) each
inference call is a span tree under the caller's W3C ``traceparent`` (gRPC metadata or an HTTP
header), or a new trace without one:

    batchgate.infer          the call (model, transport, rows)
      admission              the tenant's limits
      queue                  one per request part: from queued to dispatched
      response               encoding the answer
    batch                    one per engine run, linked to every request it served (size, rows,
      compute                bucket); the run itself

A batch serves many callers' traces at once, so it is a span of its own with links, not a child
of any one of them (OpenTelemetry's rule for fan-in). Spans are exported in batches off the
event loop by the SDK's BatchSpanProcessor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

TRACER = None  # an opentelemetry Tracer while tracing is on; None (the default) costs nothing
_PROPAGATOR = None
_PROVIDER = None
HEADERS = ("traceparent", "tracestate")  # what is read from metadata / headers when on


def setup(settings) -> None:
    """Turn tracing on when the settings name an OTLP endpoint (the server calls this once)."""
    endpoint = getattr(settings, "otel_endpoint", None)
    if not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            f"otel_endpoint is set but OpenTelemetry is not installed ({exc}): reinstall batchgate with its dependencies"
        ) from None
    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    start(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)), settings.otel_service_name)
    log.info("tracing on: OTLP/HTTP spans to %s (service %s)", url, settings.otel_service_name)


def start(processor, service_name: str = "batchgate") -> None:
    """Tracing on with ``processor`` (tests pass a SimpleSpanProcessor over an in-memory exporter)."""
    global TRACER, _PROPAGATOR, _PROVIDER
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROVIDER = TracerProvider(resource=Resource.create({"service.name": service_name}))
    _PROVIDER.add_span_processor(processor)
    TRACER = _PROVIDER.get_tracer("batchgate")
    _PROPAGATOR = TraceContextTextMapPropagator()


def stop() -> None:
    """Flush and turn tracing off (the server's shutdown)."""
    global TRACER, _PROVIDER
    if _PROVIDER is not None:
        _PROVIDER.shutdown()
    TRACER = _PROVIDER = None


def extract(metadata: Iterable[tuple[str, str]] | None):
    """The caller's trace context from lower-case metadata / headers (None: start a new trace)."""
    if not metadata:
        return None
    carrier = {k: v for k, v in metadata if k in HEADERS}
    return _PROPAGATOR.extract(carrier) if carrier else None


def current():
    """The span context of the current span (a request's, captured when it is queued)."""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None


def begin_call(model: str, pass_, transport: str):
    """The call's span, made current for the task (its admission, queue and response spans are
    its children); returns what ``end_call`` takes."""
    from opentelemetry import context, trace

    span = TRACER.start_span(
        "batchgate.infer", context=pass_.trace, kind=trace.SpanKind.SERVER,
        attributes={"batchgate.model": model, "batchgate.transport": transport},
    )  # fmt: skip
    return span, context.attach(trace.set_span_in_context(span))


def end_call(state, error: BaseException | None = None) -> None:
    from opentelemetry import context
    from opentelemetry.trace import Status, StatusCode

    span, token = state
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {str(error)[:200]}"))
    span.end()
    try:
        context.detach(token)
    except ValueError:  # (detached in another context: the task was cancelled mid-way)
        pass


# The scheduler's clock is time.monotonic; spans want epoch nanoseconds.
_EPOCH_OFFSET_NS = time.time_ns() - int(time.monotonic() * 1e9)


def epoch_ns(monotonic_s: float) -> int:
    return _EPOCH_OFFSET_NS + int(monotonic_s * 1e9)


def queue_spans(batch, start_s: float) -> None:
    """One ``queue`` span per request of ``batch``, from its arrival to ``start_s`` (dispatch)."""
    from opentelemetry import trace

    end = epoch_ns(start_s)
    for r in batch:
        if r.trace is not None:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(r.trace))
            span = TRACER.start_span("queue", context=parent, start_time=epoch_ns(r.arrival))
            span.end(end_time=end)


def batch_span(batch, start_s: float, model: str):
    """The batch's span, linked to each request's, and its ``compute`` child (both ended by
    ``end_batch``)."""
    from opentelemetry import trace
    from opentelemetry.trace import Link

    links = [Link(r.trace) for r in batch if r.trace is not None]
    t0 = epoch_ns(start_s)
    span = TRACER.start_span(
        "batch", context=trace.set_span_in_context(trace.INVALID_SPAN), links=links, start_time=t0,
        attributes={
            "batchgate.model": model, "batchgate.batch.requests": len(batch),
            "batchgate.batch.rows": sum(r.rows for r in batch), "batchgate.batch.bucket": str(batch[0].key),
        },
    )  # fmt: skip
    compute = TRACER.start_span("compute", context=trace.set_span_in_context(span), start_time=t0)
    return span, compute


def end_batch(spans, error: BaseException | None = None) -> None:
    span, compute = spans
    now = time.time_ns()
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        compute.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    compute.end(end_time=now)
    span.end(end_time=now)
