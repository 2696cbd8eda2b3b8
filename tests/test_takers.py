"""The extra takers of new gRPC calls (gateway/transport/takers.py), on a real grpc.aio server on
loopback: every call they take is served by the same handlers and interceptors as grpc.aio's own
loop would, a call they refuse is answered UNAVAILABLE with the retry hint and never reaches a
handler, and the server stops cleanly with them running."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from batchgate.gateway.admission.door import PRIOR, CallCap
from batchgate.gateway.transport import takers
from batchgate.gateway.transport.takers import CallTakers

_METHOD = "/t.Echo/Call"
GATED_SEEN: list[bool] = []  # PRIOR.asked as each handler saw it


def test_the_installed_grpcio_has_what_the_takers_use():
    # An upgrade of grpcio that moves these internals must fail here, not silently lose the takers.
    assert takers.available() == ""
    assert grpc.__version__.startswith(takers.WRITTEN_FOR)


def test_a_live_server_says_its_takers_are_on(server):
    assert "gRPC call takers on: " in server.log()


class _Seen(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation, details):
        self.methods.append(details.method)
        return await continuation(details)


class _Gate:
    """The overload gate as the takers see it: ``decide(time_left)`` answers take()."""

    def __init__(self, decide, shedding: bool = False) -> None:
        self.decide, self.shedding = decide, shedding
        self.asked: list[float | None] = []

    def take(self, remaining: float | None) -> bool:
        self.asked.append(remaining)
        return self.decide(remaining)

    def message(self) -> str:
        return "overloaded: test"

    def trailing(self) -> tuple:
        return (("grpc-retry-pushback-ms", "50"),)


async def _serve(n: int, take, cap: int = 1000, hold: asyncio.Event | None = None):
    handled = []
    gated = GATED_SEEN

    async def call(request: bytes, context) -> bytes:
        handled.append(request)
        gated.append(PRIOR.get().asked)
        await asyncio.sleep(0.001)  # suspends, as a batching handler does
        if hold is not None and request == b"hold":
            await hold.wait()
        return request[::-1]

    seen = _Seen()
    door = CallTakers(n, CallCap(cap), take if isinstance(take, _Gate) else _Gate(take))
    server = grpc.aio.server(
        interceptors=door.interceptors_for((seen,)), maximum_concurrent_rpcs=door.grpc_cap
    )
    door.attach(server)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    door.start()
    return server, door, port, handled, seen


@pytest.mark.parametrize("n", [0, 4])
def test_every_call_is_served_by_the_same_handlers_and_interceptors(n):
    async def main():
        server, door, port, handled, seen = await _serve(n, lambda remaining: True)
        assert door.active == (n > 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            method = ch.unary_unary(_METHOD)
            answers = await asyncio.gather(*(method(b"abc%d" % i, timeout=10) for i in range(300)))
        assert answers == [(b"abc%d" % i)[::-1] for i in range(300)]
        assert len(handled) == 300 and seen.methods == [_METHOD] * 300
        if n:
            assert door.taken > 0 and door.refused == 0  # the takers did take calls
        # the calls a taker took carry PRIOR.asked (the pipeline does not ask the gate twice); the
        # calls grpc.aio's own loop took do not
        assert GATED_SEEN[-300:].count(True) == door.taken
        await server.stop(1)
        await asyncio.sleep(0.05)
        assert not door._tasks
        assert all(t.done() for t in door._takers)  # core failed their requests: they ended

    asyncio.run(main())


def test_a_refused_call_never_reaches_a_handler_and_carries_the_retry_hint():
    async def main():
        decisions = {"take": True}
        gate = _Gate(lambda remaining: decisions["take"])
        server, door, port, handled, seen = await _serve(8, gate)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            method = ch.unary_unary(_METHOD)
            assert await method(b"x", timeout=10) == b"x"  # warm: the channel is connected
            assert set(gate.asked) <= {None}  # the time left is not read while the gate takes all
            decisions["take"], gate.shedding = False, True
            gate.asked.clear()
            outcomes = []
            for _ in range(40):
                try:
                    await method(b"y", timeout=10)
                    outcomes.append("ok")
                except grpc.aio.AioRpcError as exc:
                    outcomes.append(exc)
            refused = [o for o in outcomes if o != "ok"]
            # grpc.aio's own loop keeps taking some calls (it knows nothing of the door); the takers
            # refuse every call they take while the door says no
            assert len(refused) == door.refused > 0
            # while shedding the door is told each call's time left (its gRPC deadline, 10 s; core rounds the timeout header up)
            assert len(gate.asked) == door.refused and all(9 < t < 10.5 for t in gate.asked)
            for exc in refused:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert exc.details() == "overloaded: test"
                assert ("grpc-retry-pushback-ms", "50") in tuple(exc.trailing_metadata())
            assert len(handled) == 1 + outcomes.count("ok")  # no refused call ran the handler
            assert len(seen.methods) == len(handled)  # nor the interceptors
            decisions["take"], gate.shedding = True, False
            assert await method(b"z", timeout=10) == b"z"
        await server.stop(1)

    asyncio.run(main())


@pytest.mark.parametrize("n", [0, 4])
def test_the_cap_on_calls_in_progress_counts_both_loops(n):
    async def main():
        hold = asyncio.Event()
        server, door, port, handled, _ = await _serve(n, lambda remaining: True, cap=3, hold=hold)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            method = ch.unary_unary(_METHOD)
            held = [asyncio.ensure_future(method(b"hold", timeout=20)) for _ in range(3)]
            for _ in range(200):  # until all three are inside the handler
                if handled.count(b"hold") == 3:
                    break
                await asyncio.sleep(0.01)
            assert handled.count(b"hold") == 3
            for _ in range(10):  # whichever loop takes it, a fourth call is refused
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await method(b"more", timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert b"more" not in handled
            hold.set()
            assert await asyncio.gather(*held) == [b"dloh"] * 3
            for _ in range(100):  # the server counts a call done a moment after the client
                try:
                    assert await method(b"ab", timeout=10) == b"ba"
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.02)
            if n:  # every call counted in was counted out (its task ends just after the answer)
                for _ in range(100):
                    if door.cap.in_progress == 0:
                        break
                    await asyncio.sleep(0.01)
                assert door.cap.in_progress == 0
        await server.stop(1)

    asyncio.run(main())


def test_a_missing_internal_turns_the_takers_off_and_grpc_aio_serves_alone(monkeypatch, caplog):
    monkeypatch.setattr(takers, "available", lambda: "cygrpc._handle_rpc not found")

    async def main():
        server, door, port, handled, _ = await _serve(4, lambda remaining: True)
        assert not door.active
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert await ch.unary_unary(_METHOD)(b"ab", timeout=10) == b"ba"
        await server.stop(1)

    with caplog.at_level("WARNING"):
        asyncio.run(main())
    assert "extra gRPC call takers off: cygrpc._handle_rpc not found" in caplog.text
