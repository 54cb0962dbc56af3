"""Client and agent-app behaviour that today's sidecar cannot be made to show on demand
(an observer overflow, a proxy's bare `Retry-After`, a server that only ever answers
`owner_failed`), and the agent app's own answers. The server here is a real HTTP server
on loopback (uvicorn) playing a script; everything that a real sidecar can show is
tested against one in the other files."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import leasehold
from harness import ThreadedAgent, free_port, next_ip
from leasehold.agent import Session, TurnRequest, create_app


class Scripted:
    """A loopback HTTP server for one test: `app`'s routes, the requests it saw."""

    def __init__(self, routes: list[Route]) -> None:
        self.ip = next_ip()
        self.port = free_port(self.ip)
        self.server = ThreadedAgent("scripted", Starlette(routes=routes), self.ip, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def stop(self) -> None:
        self.server.kill9()


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[Scripted] = []

    def start(*routes: Route) -> Scripted:
        server = Scripted(list(routes))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def sse(*frames: str) -> bytes:
    return "".join(frames).encode()


def test_an_overflow_is_yielded_and_the_stream_resumes_from_the_last_event(serve: Any) -> None:
    seen_ids: list[str | None] = []
    scripts = [
        sse(
            "id: 1-1\nevent: token\ndata: {}\n\n",
            "id: 1-2\nevent: token\ndata: {}\n\n",
            'event: overflow\ndata: {"missed": 3, "last_event_id": "1-2"}\n\n',
        ),
        sse(
            ": keep-alive\n\n",
            "id: 1-6\nevent: token\ndata: {}\n\n",
            "event: reconnect\ndata: {}\n\n",
        ),
        sse("event: idle\ndata: {}\n\n", "id: 2-1\nevent: turn_started\ndata: {}\n\n"),
    ]

    async def stream(request: Request) -> Response:
        seen_ids.append(request.headers.get("last-event-id"))
        body = scripts[min(len(seen_ids), len(scripts)) - 1]

        async def chunks() -> Any:
            for i in range(0, len(body), 5):  # frames cut across chunks
                yield body[i : i + 5]
            if len(seen_ids) == len(scripts):
                await asyncio.sleep(30)  # the last connection stays open

        return StreamingResponse(chunks(), media_type="text/event-stream")

    server = serve(Route("/v1/sessions/{key}/stream", stream))
    with leasehold.Client([server.url]) as client, client.stream("k") as events:
        got = [next(events) for _ in range(6)]
        connections = events.connections
    assert [(e.id, e.type) for e in got] == [
        ("1-1", "token"),
        ("1-2", "token"),
        (None, "overflow"),
        ("1-6", "token"),
        (None, "idle"),
        ("2-1", "turn_started"),
    ]
    assert got[2].data == {"missed": 3, "last_event_id": "1-2"}
    assert seen_ids == [None, "1-2", "1-6"], "each reconnect sent the last id it had"
    assert [after for _, after in connections] == seen_ids


def test_a_stream_refused_with_a_directive_is_retried_and_without_one_raises(serve: Any) -> None:
    attempts: list[float] = []

    async def stream(request: Request) -> Response:
        attempts.append(time.monotonic())
        if request.path_params["key"] == "bad":
            return JSONResponse({"error": "invalid_key"}, status_code=400)
        if len(attempts) == 1:
            body = {"error": "draining", "retry": {"delay_ms": 200, "budget_ms": 5000}}
            return JSONResponse(body, status_code=503, headers={"retry-after": "1"})
        return StreamingResponse(
            iter([b"id: 1-1\nevent: e\ndata: 1\n\n"]), media_type="text/event-stream"
        )

    server = serve(Route("/v1/sessions/{key}/stream", stream))
    with leasehold.Client([server.url]) as client:
        with client.stream("k") as events:
            assert next(events).data == 1
        assert attempts[1] - attempts[0] >= 0.2, "waited the directive's delay"
        with pytest.raises(leasehold.HttpError) as bad, client.stream("bad") as events:
            next(events)
    assert (bad.value.status, bad.value.code) == (400, "invalid_key")


def test_a_bare_retry_after_is_a_directive_and_typed_refusals_are_raised(serve: Any) -> None:
    sent: list[tuple[str, str | None]] = []

    async def turns(request: Request) -> Response:
        key = request.path_params["key"]
        sent.append((key, request.headers.get("idempotency-key")))
        if key == "proxy" and len([s for s in sent if s[0] == key]) == 1:
            return Response("Service Unavailable", status_code=503, headers={"retry-after": "1"})
        if key == "busy":
            return JSONResponse({"error": "busy", "turn_id": "t-9"}, status_code=409)
        if key == "interrupted":
            return JSONResponse({"error": "interrupted"}, status_code=409)
        if key == "reused":
            return JSONResponse({"error": "idempotency_key_reused"}, status_code=422)
        return JSONResponse(
            {"ok": True}, headers={"leasehold-replayed": "true", "leasehold-epoch": "4"}
        )

    server = serve(Route("/v1/sessions/{key}/turns", turns, methods=["POST"]))
    with leasehold.Client([server.url], retry_after_budget=10) as client:
        started = time.monotonic()
        answer = client.send_turn("proxy", {})
        assert time.monotonic() - started >= 1.0
        assert (answer.directives, answer.replayed, answer.epoch) == (["unavailable"], True, 4)
        with pytest.raises(leasehold.Busy) as busy:
            client.send_turn("busy", {}, multitask="reject")
        assert busy.value.turn_id == "t-9"
        with pytest.raises(leasehold.Interrupted):
            client.send_turn("interrupted", {})
        with pytest.raises(leasehold.IdempotencyKeyReused):
            client.send_turn("reused", {}, idempotency_key="k-1")
        with pytest.raises(ValueError, match="multitask"):
            client.send_turn("x", {}, multitask="later")  # type: ignore[arg-type]
    proxy = [idem for key, idem in sent if key == "proxy"]
    assert len(proxy) == 2 and proxy[0] == proxy[1]


def test_owner_failed_is_resent_with_its_key_a_bounded_number_of_times(serve: Any) -> None:
    keys: list[str | None] = []

    async def turns(request: Request) -> Response:
        keys.append(request.headers.get("idempotency-key"))
        if request.path_params["key"] == "recovers" and len(keys) == 3:
            return JSONResponse({"ok": True}, headers={"leasehold-replayed": "true"})
        return JSONResponse({"error": "owner_failed"}, status_code=502)

    server = serve(Route("/v1/sessions/{key}/turns", turns, methods=["POST"]))
    fast = {"owner_failed_delay": 0.01}
    with leasehold.Client([server.url], **fast) as client:  # on by default
        answer = client.send_turn("recovers", {})
        assert (answer.replayed, answer.directives) == (True, ["owner_failed"] * 2)
        assert keys == [answer.idempotency_key] * 3, "every attempt carried the same key"
        keys.clear()
        with pytest.raises(leasehold.OwnerFailed):
            client.send_turn("k", {}, idempotency_key="order-1")
    assert keys == ["order-1"] * 4, "the first request and 3 re-sends, then it is raised"
    keys.clear()
    with (
        leasehold.Client([server.url], owner_failed_retries=1, **fast) as client,
        pytest.raises(leasehold.OwnerFailed),
    ):
        client.send_turn("k", {})
    assert len(keys) == 2
    keys.clear()
    options = {"owner_failed_delay": 0.05, "owner_failed_budget": 0.4}
    with (
        leasehold.Client([server.url], owner_failed_retries=1000, **options) as client,
        pytest.raises(leasehold.OwnerFailed),
    ):
        client.send_turn("k", {})
    assert 4 <= len(keys) <= 10 and len(set(keys)) == 1, "the budget ends it too"
    keys.clear()
    with (
        leasehold.Client([server.url], retry_owner_failed=False) as client,
        pytest.raises(leasehold.OwnerFailed),
    ):
        client.send_turn("k", {})
    assert len(keys) == 1, "turned off: no retry without a directive"


def test_a_refused_connection_moves_to_the_next_url_and_all_refused_is_unreachable(
    serve: Any,
) -> None:
    async def turns(request: Request) -> Response:
        return JSONResponse({"ok": True})

    server = serve(Route("/v1/sessions/{key}/turns", turns, methods=["POST"]))
    closed = f"http://{next_ip()}:{free_port('127.0.0.1')}"
    with leasehold.Client([closed, server.url]) as client:
        assert client.send_turn("k", {}).url == server.url
    with leasehold.Client([closed]) as client, pytest.raises(leasehold.Unreachable):
        client.send_turn("k", {})


# -- the agent app's own answers (no sidecar needed for these paths) ---------------------


def agent_server(serve_app: Any, **kwargs: Any) -> tuple[str, Any]:
    ip = next_ip()
    port = free_port(ip)
    app = create_app(**kwargs)
    server = ThreadedAgent("agent", app, ip, port)
    serve_app.append(server)
    return f"http://{ip}:{port}", app


@pytest.fixture
def apps() -> Iterator[list[ThreadedAgent]]:
    servers: list[ThreadedAgent] = []
    yield servers
    for server in servers:
        server.kill9()


def post(
    url: str, path: str, *, epoch: str | None = "1", turn_id: str = "t-1", **kw: Any
) -> httpx.Response:
    headers = {"leasehold-turn-id": turn_id}
    if epoch is not None:
        headers["leasehold-epoch"] = epoch
    return httpx.post(url + path, headers=headers, timeout=20, **kw)


def test_the_agent_app_answers_for_its_handler(apps: list[ThreadedAgent]) -> None:
    dead_sidecar = f"http://{next_ip()}:{free_port('127.0.0.1')}"

    async def on_turn(session: Session, request: TurnRequest) -> Any:
        what = request.json().get("do")
        if what == "fenced":
            raise leasehold.Fenced()
        if what == "refused":
            body = b'{"error":"store_unavailable","retry":{"delay_ms":1500,"budget_ms":30000}}'
            raise leasehold.HttpError(
                503, "store_unavailable", body, directive=leasehold.Directive(1500, 30000)
            )
        if what == "crash":
            raise RuntimeError("boom")
        if what == "thaw":
            await session.thaw()  # the sidecar is not there
        return {
            "key": session.key,
            "epoch": session.epoch,
            "kind": request.kind,
            "turn": session.turn_id,
        }

    url, _ = agent_server(apps, on_turn=on_turn, sidecar_url=dead_sidecar)
    ok = post(url, "/sessions/s1/events", json={})
    assert ok.json() == {"key": "s1", "epoch": 1, "kind": "event", "turn": "t-1"}
    missing = post(url, "/sessions/s1/turns", epoch=None, json={})
    assert (missing.status_code, missing.json()["error"]) == (400, "missing_epoch")
    fenced = post(url, "/sessions/s1/turns", json={"do": "fenced"})
    assert (fenced.status_code, fenced.json()) == (409, {"error": "fenced"})
    refused = post(url, "/sessions/s1/turns", json={"do": "refused"})
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "2")
    assert refused.json()["retry"] == {"delay_ms": 1500, "budget_ms": 30000}
    crash = post(url, "/sessions/s1/turns", json={"do": "crash"})
    assert (crash.status_code, crash.json()["error"]) == (500, "agent_error")
    unreachable = post(url, "/sessions/s1/turns", json={"do": "thaw"})
    assert (unreachable.status_code, unreachable.json()["error"]) == (502, "sidecar_unreachable")


def test_turns_of_a_session_run_one_at_a_time_and_cancel_interrupts_one(
    apps: list[ThreadedAgent],
) -> None:
    running: dict[str, int] = {}
    overlap: list[str] = []
    log: queue.Queue[tuple[str, str | None]] = queue.Queue()
    hold = threading.Event()
    stood_down: list[str] = []

    async def on_turn(session: Session, request: TurnRequest) -> Any:
        running[session.key] = running.get(session.key, 0) + 1
        if running[session.key] > 1:
            overlap.append(session.key)
        log.put(("started", session.turn_id))
        try:
            if request.json().get("hold"):
                await asyncio.to_thread(hold.wait, 20)
            else:
                await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            log.put(("cancelled", session.turn_id))
            raise
        finally:
            running[session.key] -= 1
        return {"turn": session.turn_id}

    url, _ = agent_server(apps, on_turn=on_turn, on_stand_down=stood_down.append)
    answers: queue.Queue[tuple[str, httpx.Response]] = queue.Queue()

    def send(key: str, turn_id: str, body: dict[str, Any]) -> threading.Thread:
        t = threading.Thread(
            target=lambda: answers.put(
                (turn_id, post(url, f"/sessions/{key}/turns", turn_id=turn_id, json=body))
            ),
            daemon=True,
        )
        t.start()
        return t

    try:
        send("a", "a-1", {"hold": True})
        assert log.get(timeout=10) == ("started", "a-1")
        send("a", "a-2", {})  # waits behind a-1
        send("b", "b-1", {})  # another session: runs now
        assert log.get(timeout=10) == ("started", "b-1")
        assert post(url, "/sessions/a/turns/a-1/cancel", json={}).status_code == 204
        assert log.get(timeout=10) == ("cancelled", "a-1")
        assert log.get(timeout=10) == ("started", "a-2"), "the next turn of a runs after"
        got = dict(answers.get(timeout=10) for _ in range(3))
        assert (got["a-1"].status_code, got["a-1"].json()) == (409, {"error": "interrupted"})
        assert got["a-2"].json() == {"turn": "a-2"} and got["b-1"].json() == {"turn": "b-1"}
        assert overlap == []

        send("c", "c-1", {"hold": True})
        assert log.get(timeout=10) == ("started", "c-1")
        assert post(url, "/sessions/c/stand-down", json={}).status_code == 204
        assert log.get(timeout=10) == ("cancelled", "c-1")
        turn_id, answer = answers.get(timeout=10)
        assert (turn_id, answer.status_code, answer.json()) == ("c-1", 409, {"error": "fenced"})
        assert stood_down == ["c"]
    finally:
        hold.set()
