"""Exactly-once turns (docs/http-api.md, the turn journal) through the SDK, against local
stand-ins for the sidecar.

The sidecar's side of these (idempotency replay, `409 busy`, `503 queue_full`, `GET` and
`DELETE` of a turn, `Leasehold-Resume`, the cancel call) is being built in the sidecar
right now; the real-sidecar versions of these tests come with it (see
test_turn_semantics.py, skipped until the sidecar under test has them). Here:

- the client talks to a small HTTP server on loopback (uvicorn) that speaks exactly
  that interface: a key with the same body runs once and is replayed with
  `Leasehold-Replayed: true`, with another body is `422 idempotency_key_reused`;
- a connection reset is a raw socket server that closes the first connection without
  answering;
- the agent app is driven in-process (httpx's ASGI transport) with a fake sidecar
  (httpx's mock transport) that serves the journal of a turn's earlier attempts.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import socket
import socketserver
import struct
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import leasehold
from harness import EXAMPLES, ThreadedAgent, free_port, next_ip
from leasehold.agent import Session, TurnRequest, create_app

FAST = {"owner_failed_delay": 0.01}


class JournalServer:
    """The public API's turn semantics, as specified, for one session store in memory."""

    def __init__(self) -> None:
        #: (session, key) -> (body digest, status, answer body)
        self.recorded: dict[tuple[str, str], tuple[str, int, dict[str, Any]]] = {}
        self.runs: list[tuple[str, str]] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.turns: dict[tuple[str, str], dict[str, Any]] = {}
        self.queue_full_once: set[str] = set()
        self.running: dict[str, str] = {}  # session -> the turn id running (for `reject`)

    async def post(self, request: Request) -> Response:
        key = request.path_params["key"]
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.requests.append(("POST", request.url.path, headers))
        idem = headers["idempotency-key"]
        body = await request.body()
        digest = hashlib.sha256(body).hexdigest()
        if key in self.queue_full_once:
            self.queue_full_once.discard(key)
            refusal = {"error": "queue_full", "retry": {"delay_ms": 20, "budget_ms": 5000}}
            return JSONResponse(refusal, status_code=503, headers={"retry-after": "1"})
        if key in self.running and headers.get("leasehold-multitask") == "reject":
            return JSONResponse({"error": "busy", "turn_id": self.running[key]}, status_code=409)
        seen = self.recorded.get((key, idem))
        if seen is not None:
            if seen[0] != digest:
                return JSONResponse({"error": "idempotency_key_reused"}, status_code=422)
            return JSONResponse(
                seen[2], status_code=seen[1], headers={"leasehold-replayed": "true"}
            )
        self.runs.append((key, idem))
        answer = {"ran": json.loads(body), "run": len(self.runs)}
        self.recorded[(key, idem)] = (digest, 200, answer)
        self.turns[(key, idem)] = {
            "turn_id": idem,
            "state": "finished",
            "epoch": 1,
            "attempts": 1,
            "answer": {
                "status": 200,
                "content_type": "application/json",
                "body": json.dumps(answer),
            },
        }
        return JSONResponse(answer, headers={"leasehold-epoch": "1", "leasehold-owner": "n"})

    async def turn(self, request: Request) -> Response:
        key, turn_id = request.path_params["key"], request.path_params["turn_id"]
        self.requests.append((request.method, request.url.path, dict(request.headers)))
        info = self.turns.get((key, turn_id))
        if info is None:
            return JSONResponse({"error": "no_such_turn"}, status_code=404)
        if request.method == "DELETE":
            info["state"] = "cancelled"
            return JSONResponse(info)
        return JSONResponse(info)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/sessions/{key}/turns", self.post, methods=["POST"]),
            Route("/v1/sessions/{key}/events", self.post, methods=["POST"]),
            Route("/v1/sessions/{key}/turns/{turn_id}", self.turn, methods=["GET", "DELETE"]),
        ]


@pytest.fixture
def journal() -> Iterator[tuple[JournalServer, str]]:
    server = JournalServer()
    ip = next_ip()
    port = free_port(ip)
    threaded = ThreadedAgent("journal", Starlette(routes=server.routes()), ip, port)
    try:
        yield server, f"http://{ip}:{port}"
    finally:
        threaded.kill9()


def test_a_repeated_key_is_replayed_and_reused_with_another_body_is_refused(
    journal: tuple[JournalServer, str],
) -> None:
    server, url = journal
    with leasehold.Client([url]) as client:
        first = client.send_turn("s", {"text": "pay"}, idempotency_key="order-7")
        again = client.send_turn("s", {"text": "pay"}, idempotency_key="order-7")
        event = client.send_event("s", {"name": "paid"})
        with pytest.raises(leasehold.IdempotencyKeyReused) as reused:
            client.send_turn("s", {"text": "refund"}, idempotency_key="order-7")
    assert (first.replayed, again.replayed, event.replayed) == (False, True, False)
    assert again.json() == first.json() == {"ran": {"text": "pay"}, "run": 1}
    assert server.runs == [("s", "order-7"), ("s", event.idempotency_key)], "ran once"
    assert (reused.value.status, reused.value.code) == (422, "idempotency_key_reused")
    generated = event.idempotency_key
    assert len(generated) == 36 and generated.count("-") == 4, "a uuid4 by default"
    sent = [h for _, path, h in server.requests if path.endswith("/turns")]
    assert {h["idempotency-key"] for h in sent} == {"order-7"}


async def test_the_async_client_sends_multitask_and_reads_busy_and_queue_full(
    journal: tuple[JournalServer, str],
) -> None:
    server, url = journal
    server.running["busy"] = "t-running"
    server.queue_full_once.add("queued")
    async with leasehold.AsyncClient([url]) as client:
        with pytest.raises(leasehold.Busy) as busy:
            await client.send_turn("busy", {"text": "x"}, multitask="reject")
        queued = await client.send_turn("queued", {"text": "y"}, multitask="enqueue")
    assert busy.value.turn_id == "t-running"
    assert queued.directives == ["queue_full"], "queue_full is a directive: re-sent"
    multitask = [h.get("leasehold-multitask") for _, _, h in server.requests]
    assert multitask == ["reject", "enqueue", "enqueue"]
    queued_keys = [h["idempotency-key"] for _, p, h in server.requests if "/queued/" in p]
    assert queued_keys == [queued.idempotency_key] * 2


def test_get_turn_and_cancel_turn(journal: tuple[JournalServer, str]) -> None:
    _, url = journal
    with leasehold.Client([url]) as client:
        answer = client.send_turn("s", {"text": "hi"})
        info = client.get_turn("s", answer.idempotency_key)
        assert client.get_turn("s", "no-such-turn") is None
        assert client.cancel_turn("s", answer.idempotency_key) is True
        assert client.cancel_turn("s", "no-such-turn") is False
        after = client.turn("s", answer.idempotency_key)
        with pytest.raises(ValueError, match="turn id"):
            client.get_turn("s", "has space")
    assert info is not None and info.finished
    assert (info.turn_id, info.epoch, info.attempts) == (answer.idempotency_key, 1, 1)
    assert info.answer is not None and info.answer.status == 200
    assert info.answer.json() == answer.json()
    assert after is not None and after.state == "cancelled"


class _DropFirst(socketserver.ThreadingTCPServer):
    """An HTTP/1.1 server on loopback that resets the first `drops` connections after
    reading their request, and answers the others `200 {"n": <request number>}`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.keys: list[str] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _DropFirstHandler)


class _DropFirstHandler(socketserver.BaseRequestHandler):
    server: _DropFirst

    def handle(self) -> None:
        sock: socket.socket = self.request
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        headers = dict(
            line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:] if line
        )
        while len(body) < int(headers.get("content-length", "0")):
            body += sock.recv(65536)
        with self.server.lock:
            self.server.keys.append(headers.get("idempotency-key", ""))
            n = len(self.server.keys)
        if n <= self.server.drops:
            # RST, not FIN: the request was sent and its answer is lost.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            return
        payload = json.dumps({"n": n}).encode()
        sock.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )


@pytest.fixture
def drop_first() -> Iterator[Any]:
    servers: list[_DropFirst] = []

    def start(drops: int) -> _DropFirst:
        server = _DropFirst(drops)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_connection_reset_after_sending_is_resent_with_the_same_key(drop_first: Any) -> None:
    server = drop_first(2)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with leasehold.Client([url], **FAST) as client:
        answer = client.send_turn("s", {"text": "x"})
    assert answer.json() == {"n": 3}
    assert answer.directives == ["connection_lost", "connection_lost"]
    assert server.keys == [answer.idempotency_key] * 3

    never = drop_first(100)
    url = f"http://127.0.0.1:{never.server_address[1]}"
    with leasehold.Client([url], **FAST) as client, pytest.raises(leasehold.ConnectionLost):
        client.send_turn("s", {"text": "x"}, idempotency_key="k-1")
    assert never.keys == ["k-1"] * 4, "the first request and 3 re-sends"

    off = drop_first(1)
    url = f"http://127.0.0.1:{off.server_address[1]}"
    with (
        leasehold.Client([url], retry_owner_failed=False) as client,
        pytest.raises(leasehold.ConnectionLost),
    ):
        client.send_turn("s", {"text": "x"})
    assert len(off.keys) == 1


# -- the agent side: resume and cancel, in-process with a fake sidecar -------------------


class FakeSidecar:
    """The agent API as a mock transport: records writes, serves a canned journal."""

    def __init__(self, journal: list[dict[str, Any]], checkpoint: Any = None) -> None:
        self.journal = journal
        self.checkpoint = checkpoint
        self.checkpoint_turn: str | None = None
        self.checkpoints: list[Any] = []
        self.requests: list[httpx.Request] = []
        self.published: list[tuple[str, Any]] = []
        self.first_step = asyncio.Event()

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if request.method == "GET" and path.endswith("/events"):
            return httpx.Response(200, json=self.journal)
        if request.method == "POST" and path.endswith("/events"):
            event = json.loads(request.content)
            self.published.append((event["type"], event["data"]))
            if event["type"] == "step":
                self.first_step.set()
            return httpx.Response(202, json={"id": f"2-{len(self.published)}"})
        if path.endswith("/checkpoint") and request.method == "PUT":
            self.checkpoint = json.loads(request.content)
            self.checkpoints.append(self.checkpoint)
            return httpx.Response(204)
        if path.endswith("/checkpoint"):
            if self.checkpoint is None:
                return httpx.Response(404)
            headers = {"leasehold-checkpoint-epoch": "1"}
            if self.checkpoint_turn is not None:
                headers["leasehold-checkpoint-turn"] = self.checkpoint_turn
            return httpx.Response(200, json=self.checkpoint, headers=headers)
        return httpx.Response(404)


def _agent(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")


def _sidecar_client(fake: FakeSidecar) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))


async def test_a_resumed_turn_reads_its_journal_at_its_epoch_and_publishes_the_rest() -> None:
    fake = FakeSidecar(
        [
            {"id": "1-1", "type": "turn_started", "data": {"text": "hi"}},
            {"id": "1-2", "type": "token", "data": {"i": 0}},
            {"id": "1-3", "type": "token", "data": {"i": 1}},
        ]
    )

    async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
        done = 0
        if session.resumed:
            journal = await session.journal_events()
            done = sum(1 for e in journal if e.type == "token")
        else:
            await session.publish("turn_started", {"text": "hi"})
        for i in range(done, 4):
            await session.publish("token", {"i": i})
        return {"resumed": request.resumed, "skipped": done, "of": session.resume_of}

    async with _sidecar_client(fake) as sidecar_http:
        app = create_app(on_turn, sidecar_url="http://sidecar", http_client=sidecar_http)
        async with _agent(app) as agent:
            headers = {"leasehold-epoch": "2", "leasehold-turn-id": "t-9"}
            resumed = await agent.post(
                "/sessions/s/turns", json={}, headers={**headers, "leasehold-resume": "t-9"}
            )
            fresh = await agent.post("/sessions/s/turns", json={}, headers=headers)
    assert resumed.json() == {"resumed": True, "skipped": 2, "of": "t-9"}
    assert fresh.json() == {"resumed": False, "skipped": 0, "of": None}
    reads = [r for r in fake.requests if r.method == "GET" and r.url.path.endswith("/events")]
    assert [(r.url.path, r.headers.get("leasehold-epoch")) for r in reads] == [
        ("/v1/sessions/s/turns/t-9/events", "2")
    ], "read once, at the turn's epoch (the attempts below it)"
    resumed_part = fake.published[:2]
    assert resumed_part == [("token", {"i": 2}), ("token", {"i": 3})], "no turn_started again"


async def test_cancel_tells_the_handler_stops_its_writes_and_answers_once_it_ended() -> None:
    fake = FakeSidecar([])
    started = asyncio.Event()
    seen: dict[str, Any] = {}
    hooks: list[tuple[str, str]] = []

    async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
        await session.publish("turn_started", {})
        watcher = asyncio.create_task(session.cancelled.wait())  # e.g. a model call's task
        started.set()
        try:
            await asyncio.Event().wait()  # a long turn
        except asyncio.CancelledError:
            seen["reason"] = session.cancel_reason
            await asyncio.wait_for(watcher, 1)
            seen["watcher"] = watcher.done()
            try:
                await session.publish("token", {"late": True})  # too late: never sent
            except leasehold.Interrupted as e:
                seen["late_write"] = e.code
            raise
        return {}

    async with _sidecar_client(fake) as sidecar_http:
        app = create_app(
            on_turn,
            on_cancel=lambda key, turn_id: hooks.append((key, turn_id)),
            sidecar_url="http://sidecar",
            http_client=sidecar_http,
        )
        async with _agent(app) as agent:
            headers = {"leasehold-epoch": "1", "leasehold-turn-id": "t-1"}
            turn = asyncio.create_task(agent.post("/sessions/s/turns", json={}, headers=headers))
            await asyncio.wait_for(started.wait(), 5)
            cancel = await agent.post("/sessions/s/turns/t-1/cancel")
            assert "late_write" in seen, "the cancel is answered once the handler ended"
            answer = await asyncio.wait_for(turn, 5)
            other = await agent.post("/sessions/s/turns/t-unknown/cancel")
    assert cancel.status_code == 204 and other.status_code == 204
    assert (answer.status_code, answer.json()) == (409, {"error": "interrupted"})
    assert seen == {"reason": "interrupted", "watcher": True, "late_write": "interrupted"}
    assert hooks == [("s", "t-1")], "on_cancel for the running turn only"
    assert fake.published == [("turn_started", {})], "nothing published after the cancel"


def resumable_example() -> ModuleType:
    """examples/resumable_agent.py (the docs' resume and cancel example), imported."""
    spec = importlib.util.spec_from_file_location(
        "resumable_agent", EXAMPLES / "resumable_agent.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["resumable_agent"] = module
    spec.loader.exec_module(module)
    return module


async def test_the_resumable_example_resumes_once_and_stops_when_cancelled() -> None:
    example = resumable_example()
    # Epoch 1 published turn_started and steps 0 and 1, then its pod died.
    journal = [
        {"id": "1-1", "type": "turn_started", "data": {"text": "go"}},
        {"id": "1-2", "type": "step", "data": {"i": 0, "result": "result 0"}},
        {"id": "1-3", "type": "step", "data": {"i": 1, "result": "result 1"}},
    ]
    resumed = FakeSidecar(journal, checkpoint={"history": ["before"]})
    headers = {"leasehold-epoch": "2", "leasehold-turn-id": "t-1", "leasehold-resume": "t-1"}
    async with _sidecar_client(resumed) as sidecar_http:
        app = create_app(example.on_turn, sidecar_url="http://sidecar", http_client=sidecar_http)
        async with _agent(app) as agent:
            answer = await agent.post(
                "/sessions/s/turns", json={"text": "go", "steps": 4}, headers=headers
            )
    assert answer.json() == {"history_len": 2, "resumed": True}
    assert [(t, d.get("i")) for t, d in resumed.published] == [
        ("step", 2),
        ("step", 3),
        ("turn_finished", None),
    ]
    assert resumed.checkpoints == [{"history": ["before", "go"], "last_turn": "t-1"}]

    # The first attempt had checkpointed and finished: the resume adds nothing.
    finished = FakeSidecar(
        [*journal[:2], {"id": "1-4", "type": "turn_finished", "data": {}}],
        checkpoint={"history": ["before", "go"], "last_turn": "t-1"},
    )
    async with _sidecar_client(finished) as sidecar_http:
        app = create_app(example.on_turn, sidecar_url="http://sidecar", http_client=sidecar_http)
        async with _agent(app) as agent:
            answer = await agent.post(
                "/sessions/s/turns", json={"text": "go", "steps": 1}, headers=headers
            )
    assert answer.json() == {"history_len": 2, "resumed": True}
    assert finished.published == [] and finished.checkpoints == []

    cancelled = FakeSidecar([])
    async with _sidecar_client(cancelled) as sidecar_http:
        app = create_app(
            example.on_turn,
            on_cancel=example.cancelled,
            sidecar_url="http://sidecar",
            http_client=sidecar_http,
        )
        async with _agent(app) as agent:
            fresh = {"leasehold-epoch": "1", "leasehold-turn-id": "t-2"}
            turn = asyncio.create_task(
                agent.post("/sessions/s/turns", json={"text": "x", "steps": 1000}, headers=fresh)
            )
            await asyncio.wait_for(cancelled.first_step.wait(), 5)
            assert (await agent.post("/sessions/s/turns/t-2/cancel")).status_code == 204
            stopped_at = len(cancelled.published)
            answer = await asyncio.wait_for(turn, 5)
    assert (answer.status_code, answer.json()) == (409, {"error": "interrupted"})
    assert len(cancelled.published) == stopped_at < 1000, "nothing published after the cancel"
    assert cancelled.published[0][0] == "turn_started" and cancelled.checkpoints == []


async def test_the_python_demo_agent_resumes_like_the_rust_one() -> None:
    from leasehold.demo_agent import DemoAgent

    journal = [
        {"id": "1-1", "type": "turn_started", "data": {"text": "hi"}},
        {"id": "1-2", "type": "token", "data": {"i": 0, "text": "tok0"}},
        {"id": "1-3", "type": "token", "data": {"i": 1, "text": "tok1"}},
    ]
    fake = FakeSidecar(journal, checkpoint={"history": ["before"]})
    headers = {"leasehold-epoch": "2", "leasehold-turn-id": "t-9", "leasehold-resume": "t-9"}
    async with _sidecar_client(fake) as sidecar_http:
        demo = DemoAgent("node-p")
        app = create_app(demo.on_turn, sidecar_url="http://sidecar", http_client=sidecar_http)
        async with _agent(app) as agent:
            answer = await agent.post("/sessions/s/turns", json={"text": "hi"}, headers=headers)
            # The same turn resumed again after it checkpointed: nothing appended twice.
            again = await agent.post("/sessions/s/turns", json={"text": "hi"}, headers=headers)
    assert answer.json() == {"history_len": 2, "epoch": 2, "node": "node-p"}
    assert again.json() == answer.json()
    assert [(t, d.get("i")) for t, d in fake.published[:4]] == [
        ("token", 2),
        ("token", 3),
        ("token", 4),
        ("turn_finished", None),
    ], "no second turn_started, only the tokens not journaled"
    assert fake.checkpoints == [{"history": ["before", "hi"], "last_turn": "t-9"}]


async def test_thaw_reads_the_turn_that_wrote_the_checkpoint() -> None:
    fake = FakeSidecar([], checkpoint={"history": ["a"]})
    fake.checkpoint_turn = "t-7"
    seen: list[tuple[Any, int | None, str | None]] = []

    async def on_turn(session: Session, request: TurnRequest) -> None:
        seen.append((await session.thaw_json(), session.checkpoint_epoch, session.checkpoint_turn))

    async with _sidecar_client(fake) as sidecar_http:
        app = create_app(on_turn, sidecar_url="http://sidecar", http_client=sidecar_http)
        async with _agent(app) as agent:
            headers = {
                "leasehold-epoch": "2",
                "leasehold-turn-id": "t-7",
                "leasehold-resume": "t-7",
            }
            await agent.post("/sessions/s/turns", json={}, headers=headers)
            fake.checkpoint_turn = None  # written between turns
            await agent.post("/sessions/s/turns", json={}, headers=headers)
    assert seen == [({"history": ["a"]}, 1, "t-7"), ({"history": ["a"]}, 1, None)]
