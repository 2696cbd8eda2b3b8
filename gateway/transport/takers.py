"""More than one taker of new calls from gRPC core, and the cheapest refusal there is.

grpc.aio's server takes new calls from gRPC core one at a time: its main loop asks core for a call,
awaits it, starts the call's tasks, and only then asks for the next — at least two event-loop
turns per call. When the loop is busy (a batch's answers, other calls' decoding), turns are long
and calls are taken more slowly than they arrive. The rest wait inside core, first in first out,
where no Python code sees them, and under a sustained overload the call taken next is always the
oldest one still alive: it arrives in Python with its deadline nearly spent, so the server works on
calls that then miss their budgets while fresh ones queue behind them (goodput falls to nothing;
docs/performance.md, "Overload").

``CallTakers`` keeps ``n`` more requests for calls outstanding in core beside grpc.aio's own, so a
burst of pending calls is taken in one turn and core's queue stays short. Each call taken here
either goes down grpc.aio's own path (``_handle_rpc`` with the same handlers and interceptors,
inside ``_schedule_rpc_coro``, exactly what the main loop does) or is answered on the spot:
RESOURCE_EXHAUSTED past the door's cap on calls in progress (``CallCap``, counted here for both
loops), UNAVAILABLE while the load shedder sheds. One status batch, no handler, no message read:
cheaper than a refusal from a handler (docs/overload.md, "The bound, measured in one run").

These are grpc.aio internals (``AioServer._request_call``, three ``cygrpc`` functions and
``_ServicerContext.time_remaining`` for the call's deadline, grpcio 1.81). ``available()`` checks
each is there with the signature used here; when one is not, the server runs on grpc.aio's own
loop alone and says so once in the log. tests/test_takers.py checks
the installed grpcio still has them.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging

import grpc

from batchgate.gateway.admission.door import ASKED, PRIOR, CallCap

log = logging.getLogger(__name__)

try:
    from grpc._cython import cygrpc
except ImportError:  # pragma: no cover - grpcio always ships it
    cygrpc = None

_RESOURCE_EXHAUSTED, _UNAVAILABLE = 8, 14  # grpc_status_code values, fixed by gRPC's wire protocol

# (function, the argument names this module passes, in order)
_NEEDED = (
    ("_handle_rpc", ("generic_handlers", "interceptors", "rpc_state", "loop", "concurrency_exceeded")),
    ("_schedule_rpc_coro", ("rpc_coro", "rpc_state", "loop")),
    ("_send_error_status_from_server",
     ("grpc_call_wrapper", "code", "details", "trailing_metadata", "send_initial_metadata_op", "loop")),
)  # fmt: skip


WRITTEN_FOR = "1.81."  # the grpcio line these internals were read from; any other turns the takers off


def available() -> str:
    """'' when the grpc.aio internals used here are present as expected, else what is missing."""
    if not grpc.__version__.startswith(WRITTEN_FOR):
        return f"written against grpcio {WRITTEN_FOR}x, installed {grpc.__version__}"
    if cygrpc is None:
        return "grpc._cython.cygrpc not importable"
    for name, args in _NEEDED:
        fn = getattr(cygrpc, name, None)
        code = getattr(fn, "__code__", None)
        if code is None or tuple(code.co_varnames[: code.co_argcount]) != args:
            return f"cygrpc.{name}{args} not found"
    for name in ("SendInitialMetadataOperation", "_ServicerContext"):
        if not hasattr(cygrpc, name):
            return f"cygrpc.{name} not found"
    if not hasattr(getattr(cygrpc, "_ServicerContext"), "time_remaining"):
        return "cygrpc._ServicerContext.time_remaining not found"
    if not hasattr(getattr(cygrpc, "AioServer", None), "_request_call"):
        return "cygrpc.AioServer._request_call not found"
    return ""


class CallTakers:
    """``n`` extra takers of new calls for one grpc.aio server, which hold the server to the door's
    cap on calls in progress (``cap``: gateway/admission/door.py; grpc.aio's own
    ``maximum_concurrent_rpcs`` knows only the calls its loop took). Make it before the server, build the server with ``interceptors(theirs)`` and
    ``maximum_concurrent_rpcs=self.grpc_cap``, ``attach`` it before any handler is added (it records
    them as they are), ``start`` it after ``server.start()``.

    ``shedder`` is the load shedder (gateway/admission/gate.py: ``shedding``, ``take(time_left)``,
    ``message()``, ``trailing()``): ``take`` is asked once per call taken here, before anything
    else, with the call's time left (read only while it sheds); False answers the call UNAVAILABLE with
    ``message()`` and ``trailing()`` at once. It is blind to the method (core has not told Python
    which one yet), so probes belong on the health port when shedding matters."""

    def __init__(self, n: int, cap: CallCap, shedder) -> None:
        self.n = n
        self.cap = cap
        self.handlers: list = []
        self.interceptors: tuple = ()
        self.shedder = shedder
        self.taken = 0  # calls taken here (not by grpc.aio's own loop)
        self.refused = 0  # of which answered UNAVAILABLE at the door
        self._tasks: set[asyncio.Task] = set()
        self._takers: list[asyncio.Task] = []
        self.why_not = available() if n > 0 else "off (grpc_takers=0)"
        self.server: grpc.aio.Server | None = None

    @property
    def enabled(self) -> bool:
        return not self.why_not

    @property
    def active(self) -> bool:
        return bool(self._takers)

    @property
    def grpc_cap(self) -> int | None:
        """grpc.aio's own cap: none when the takers count every call themselves."""
        return None if self.enabled else self.cap.limit

    def interceptors_for(self, theirs: tuple) -> tuple:
        """The server's interceptors: the calls grpc.aio's own loop takes are counted by the first."""
        self.interceptors = tuple(theirs)
        return ((_Counted(self.cap),) if self.enabled else ()) + self.interceptors

    def attach(self, server: grpc.aio.Server) -> None:
        self.server = server
        add = server.add_generic_rpc_handlers

        def recording(handlers) -> None:
            self.handlers.extend(handlers)
            add(handlers)

        server.add_generic_rpc_handlers = recording

    def start(self) -> None:
        if self.why_not:
            if self.n > 0:
                log.warning(
                    "extra gRPC call takers off: %s; grpc.aio's own loop takes every call", self.why_not
                )
            return
        if self.n > 0:
            log.info(
                "gRPC call takers on: %d beside grpc.aio's own loop (grpcio %s)", self.n, grpc.__version__
            )
        aio = self.server._server
        loop = asyncio.get_running_loop()
        self._takers = [
            loop.create_task(self._take(aio, loop), name=f"grpc-taker-{i}") for i in range(self.n)
        ]

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self.cap.in_progress -= 1

    async def _take(self, aio, loop: asyncio.AbstractEventLoop) -> None:
        handle_rpc, schedule = cygrpc._handle_rpc, cygrpc._schedule_rpc_coro
        send_error, initial_md = cygrpc._send_error_status_from_server, cygrpc.SendInitialMetadataOperation
        context_of = cygrpc._ServicerContext
        tasks, done, shedder, cap = self._tasks, self._done, self.shedder, self.cap
        taken = contextvars.copy_context()
        taken.run(PRIOR.set, ASKED)  # the door does not ask the shedder again for these calls
        while aio.is_running():
            try:
                state = await aio._request_call()
            except asyncio.CancelledError:
                raise
            except Exception:  # core fails outstanding requests when the server shuts down
                return
            self.taken += 1
            if cap.in_progress >= cap.limit:
                coro = _refuse(
                    send_error(state, _RESOURCE_EXHAUSTED, cap.DETAILS, (), initial_md((), 0), loop)
                )
            # the time left is read only while shedding (a context object per call otherwise)
            elif not shedder.take(
                context_of(state, None, None, loop).time_remaining() if shedder.shedding else None
            ):
                self.refused += 1
                coro = _refuse(
                    send_error(
                        state, _UNAVAILABLE, shedder.message(), shedder.trailing(), initial_md((), 0), loop
                    )
                )
            else:
                coro = schedule(handle_rpc(self.handlers, self.interceptors, state, loop, False), state, loop)
            cap.in_progress += 1
            task = loop.create_task(coro, context=taken.copy())  # its own copy, PRIOR=ASKED in it
            tasks.add(task)
            task.add_done_callback(done)


class _Counted(grpc.aio.ServerInterceptor):
    """Counts the calls grpc.aio's own loop takes in the door's ``CallCap`` (the takers count
    theirs as they take them) and refuses one past the cap RESOURCE_EXHAUSTED, as grpc.aio would."""

    def __init__(self, cap: CallCap) -> None:
        self.cap = cap

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        kind = (
            ("stream" if handler.request_streaming else "unary")
            + "_"
            + ("stream" if handler.response_streaming else "unary")
        )
        return handler._replace(**{kind: self._wrap(getattr(handler, kind))})

    def _wrap(self, behaviour):
        cap = self.cap
        if inspect.isasyncgenfunction(behaviour):

            async def counted_gen(request, context):
                if cap.in_progress >= cap.limit:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, cap.DETAILS)
                cap.in_progress += 1
                try:
                    async for item in behaviour(request, context):
                        yield item
                finally:
                    cap.in_progress -= 1

            return counted_gen

        async def counted(request, context):
            if cap.in_progress >= cap.limit:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, cap.DETAILS)
            cap.in_progress += 1
            try:
                result = behaviour(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                cap.in_progress -= 1

        return counted


async def _refuse(send) -> None:
    try:
        await send
    except Exception:  # the caller has gone (cancelled, or the server stopping): nothing to tell
        pass
