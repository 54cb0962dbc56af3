"""docs/openapi.yaml and docs/openapi-agent.yaml against running sidecars.

Three real sidecars on loopback, each with an in-process agent that records every request
the sidecar sends it and does what the turn's body asks (sleep, publish, checkpoint,
answer big, break its answer off, answer 409). The test provokes every documented status
of every route it can on loopback, checks each answer against the document (route,
status, Content-Type, body schema, required headers) and each request to an agent against
its webhook, and at the end fails for any documented (route, status) or webhook it never
saw, except those marked `x-not-on-loopback`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from openapi_spec_validator import validate as validate_spec

import harness
from openapi_check import Coverage, Document, Exchange, Undocumented, load

#: The agent sleeps this long in a turn that must still be running when the test acts.
LONG_TURN_S = 6.0
#: A turn that keeps its session busy while two more arrive.
SHORT_TURN_S = 3.0
#: How long the test waits for a condition the sidecars reach in well under a second.
SETTLE_S = 15.0
#: Every request's timeout: the longest answer provoked here is a drain (a few seconds).
REQUEST_TIMEOUT_S = 60.0
#: Long enough that a killed owner's lease is surely still live when the test asks for
#: its session (`takeover_pending`) on a loaded machine; short enough to wait out once.
LEASE_TTL_MS = 10_000
#: Small limits the test can reach: connections per listener, turns waiting per session,
#: bytes in an agent's answer, streams per session.
MAX_CONNECTIONS = 16
MAX_ANSWER_BYTES = 4096
SIDECAR_ARGS = [
    "--max-connections",
    str(MAX_CONNECTIONS),
    "--queue-limit",
    "1",
    "--max-answer-bytes",
    str(MAX_ANSWER_BYTES),
    "--max-streams-per-session",
    "1",
    "--max-turn-attempts",
    "2",
    # The killed owner's session must wait for its lease (`takeover_pending` is covered):
    # with connection liveness on it would move at once.
    "--connection-liveness=false",
]


@dataclass
class Seen:
    method: str
    raw_path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class RecordingAgent:
    """An ASGI agent: records each request from its sidecar and obeys the turn's body,
    a JSON object with optional `sleep` (seconds), `publish` and `checkpoint` (through the
    agent API), `answer_bytes` (a text answer that long), `break_once` (the first attempt's
    answer breaks off), `break_always` (every attempt's does), `status` (the answer's status)."""

    agent_api: str
    name: str
    requests: list[Seen] = field(default_factory=list)
    cancel_delay: float = 0.0
    broken: set[str] = field(default_factory=set)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        self.requests.append(Seen(scope["method"], raw_path, headers, body))
        path: str = scope["path"]
        if path.endswith("/cancel"):
            await asyncio.sleep(self.cancel_delay)
            return await _respond(send, 204, b"", None)
        if path.endswith("/stand-down"):
            return await _respond(send, 204, b"", None)
        command: dict[str, Any] = json.loads(body) if body.startswith(b"{") else {}
        epoch, turn, key = (
            headers["leasehold-epoch"],
            headers["leasehold-turn-id"],
            path.split("/")[2],
        )
        write = {"Leasehold-Epoch": epoch}
        async with httpx.AsyncClient(base_url=self.agent_api, timeout=REQUEST_TIMEOUT_S) as api:
            if command.get("publish"):
                await api.post(
                    f"/v1/sessions/{key}/events",
                    json={"type": "token", "data": {"i": 0}},
                    headers=write,
                )
            if command.get("checkpoint"):
                await api.put(f"/v1/sessions/{key}/checkpoint", content=b"state", headers=write)
        await asyncio.sleep(float(command.get("sleep", 0)))
        if command.get("break_always") or (command.get("break_once") and turn not in self.broken):
            self.broken.add(turn)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", b"100")],
                }
            )
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("the answer breaks off (on purpose)")
        if "answer_bytes" in command:
            return await _respond(send, 200, b"x" * int(command["answer_bytes"]), "text/plain")
        answer = {"epoch": int(epoch), "node": self.name, "turn": turn}
        await _respond(
            send, int(command.get("status", 200)), json.dumps(answer).encode(), "application/json"
        )


async def _respond(send: Any, status: int, body: bytes, content_type: str | None) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type:
        headers.append((b"content-type", content_type.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def proof(secret: str, method: str, path: str, node: str) -> dict[str, str]:
    """The Leasehold-Peer-* headers for a bodiless admin request (docs/http-api.md)."""
    signed = ["leasehold-turn-id", "content-type"]
    ts, nonce = str(int(time.time() * 1000)), secrets.token_hex(16)
    message = "\n".join(
        ["leasehold-peer-v2", method, path, ts, nonce, node]
        + [f"{name}:" for name in signed]
        + [hashlib.sha256(b"").hexdigest()]
    )
    signature = hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()
    return {
        "Leasehold-Peer-Timestamp": ts,
        "Leasehold-Peer-Nonce": nonce,
        "Leasehold-Peer-Signed-Headers": ",".join(signed),
        "Leasehold-Peer-Signature": signature,
    }


def drain_hook_token(secret: str, port: int | None, path: str | None, sleep: int | None) -> str:
    """The drain-hook token made for these then_* values (docs/http-api.md, GET /drained)."""
    message = b"leasehold-drain-hook-v1"
    if port is not None:
        message += f"\nthen_port={port}".encode()
    if path is not None:
        message += f"\nthen_path={len(path.encode())}:".encode() + path.encode()
    if sleep is not None:
        message += f"\nthen_sleep={sleep}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Api:
    """Requests to one listener, each checked against its document and recorded."""

    def __init__(self, coverage: Coverage, document: Document, base: str) -> None:
        self.coverage, self.document, self.base = coverage, document, base

    def __call__(
        self, method: str, path: str, expect: int | None = None, **kw: Any
    ) -> httpx.Response:
        kw.setdefault("timeout", REQUEST_TIMEOUT_S)
        response = httpx.request(method, self.base + path, **kw)
        self.coverage.record(
            self.document,
            Exchange(method, path, response.status_code, dict(response.headers), response.content),
        )
        if expect is not None:
            assert response.status_code == expect, (
                f"{method} {path}: {response.status_code} {response.text[:300]}"
            )
        return response

    def stream(self, path: str, expect: int, **kw: Any) -> None:
        """Open a stream, check its head (and body, when it is a refusal), close it."""
        with httpx.stream("GET", self.base + path, timeout=REQUEST_TIMEOUT_S, **kw) as response:
            body = None if response.status_code == 200 else response.read()
            self.coverage.record(
                self.document,
                Exchange("GET", path, response.status_code, dict(response.headers), body),
            )
            assert response.status_code == expect, f"stream {path}: {response.status_code}"

    def cut_off(self, path: str) -> Exchange:
        """A POST whose body breaks off: half of its Content-Length, then the client's
        side of the connection is shut."""
        host, port = self.base.removeprefix("http://").rsplit(":", 1)
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\n"
        with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S) as s:
            s.sendall(head.encode() + b"x" * 50)
            s.shutdown(socket.SHUT_WR)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        head_bytes, _, body = raw.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        exchange = Exchange("POST", path, int(lines[0].split()[1]), headers, body)
        self.coverage.record(self.document, exchange)
        return exchange

    def background(self, method: str, path: str, **kw: Any) -> Callable[[], httpx.Response]:
        """Send in a thread; the returned function joins it and gives its response."""
        out: list[Any] = []

        def run() -> None:
            try:
                out.append(self(method, path, **kw))
            except BaseException as e:
                out.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        def join() -> httpx.Response:
            thread.join(REQUEST_TIMEOUT_S)
            assert out, f"{method} {path} did not answer"
            if isinstance(out[0], BaseException):
                raise out[0]
            result: httpx.Response = out[0]
            return result

        return join


def _error(response: httpx.Response) -> str:
    body = response.json()
    return str(body.get("error")) if isinstance(body, dict) else ""


# -- the checker itself ------------------------------------------------------------------


def test_the_documents_are_valid_openapi_3_1() -> None:
    for document in load():
        assert document.doc["openapi"].startswith("3.1"), document.path
        validate_spec(document.doc)


def test_the_checker_refuses_an_undocumented_route_status_header_or_shape() -> None:
    client, _ = load()
    good = Exchange(
        "GET",
        "/v1/sessions/chat-1",
        200,
        {"content-type": "application/json"},
        json.dumps(
            {
                "key": "chat-1",
                "owner": None,
                "epoch": None,
                "expires_in_ms": None,
                "claimable": True,
            }
        ).encode(),
    )
    assert client.check(good) == ("/v1/sessions/{key}", "200")
    with pytest.raises(Undocumented, match="no such route"):
        client.check(Exchange("GET", "/v1/nothing", 200, {}, b""))
    with pytest.raises(Undocumented, match="status 418 is not documented"):
        client.check(Exchange("GET", "/v1/sessions/chat-1", 418, {}, b""))
    with pytest.raises(Undocumented, match="does not match"):
        client.check(
            Exchange("GET", "/v1/sessions/chat-1", 200, {"content-type": "application/json"}, b"{}")
        )
    with pytest.raises(Undocumented, match="required header Retry-After"):
        client.check(
            Exchange(
                "GET",
                "/v1/sessions/chat-1",
                503,
                {"content-type": "application/json", "leasehold-refusal": "store_unavailable"},
                b'{"error":"store_unavailable","retry":{"delay_ms":1000,"budget_ms":30000}}',
            )
        )
    # A status deleted from the document is undocumented from then on.
    edited = copy.deepcopy(client)
    del edited.doc["paths"]["/v1/sessions/{key}"]["get"]["responses"]["400"]
    bad_key = Exchange(
        "GET",
        "/v1/sessions/a%20b",
        400,
        {"content-type": "application/json"},
        b'{"error":"invalid_key"}',
    )
    client.check(bad_key)
    with pytest.raises(Undocumented, match="status 400"):
        edited.check(bad_key)


# -- against the running sidecars --------------------------------------------------------


def _drop_database(database_url: str) -> None:
    name = database_url.split("?", 1)[0].rsplit("/", 1)[1]
    with psycopg.connect(harness.admin_url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")  # type: ignore[arg-type]


def test_every_documented_route_and_status_against_running_sidecars(
    make_cluster: Callable[..., harness.Cluster], database_url: str, tmp_path: Path
) -> None:
    client_doc, agent_doc = load()
    coverage = Coverage([client_doc, agent_doc])
    agents: dict[str, RecordingAgent] = {}

    def recording(node: harness.Node) -> RecordingAgent:
        agents[node.name] = RecordingAgent(node.agent_api_url, node.name)
        return agents[node.name]

    cluster = make_cluster(
        nodes=3,
        agents=dict.fromkeys(range(3), recording),
        sidecar_args=SIDECAR_ARGS,
        lease_ttl_ms=LEASE_TTL_MS,
    )
    a, b, c = cluster.nodes
    pub = {n.name: Api(coverage, client_doc, n.public_url) for n in cluster.nodes}
    adm = {n.name: Api(coverage, client_doc, n.admin_url) for n in cluster.nodes}
    api = {n.name: Api(coverage, agent_doc, n.agent_api_url) for n in cluster.nodes}
    A, B, C = pub[a.name], pub[b.name], pub[c.name]

    def agent_has(node: harness.Node, turn_id: str) -> Callable[[], bool]:
        return lambda: any(
            r.headers.get("leasehold-turn-id") == turn_id for r in agents[node.name].requests
        )

    def key_header(k: str) -> dict[str, str]:
        return {"Idempotency-Key": k}

    # ---- turns: answered, repeated, refused for bad input --------------------------------
    first = A(
        "POST",
        "/v1/sessions/main/turns",
        200,
        json={"publish": 1, "checkpoint": 1},
        headers=key_header("t1"),
    )
    epoch = int(first.headers["leasehold-epoch"])
    again = B(
        "POST",
        "/v1/sessions/main/turns",
        200,
        json={"publish": 1, "checkpoint": 1},
        headers=key_header("t1"),
    )
    assert again.headers.get("leasehold-replayed") == "true" and again.content == first.content
    A("POST", "/v1/sessions/main/turns", 422, json={"other": 1}, headers=key_header("t1"))
    A("POST", "/v1/sessions/bad%20key/turns", 400, json={})
    A("POST", "/v1/sessions/main/turns", 400, json={}, headers={"Idempotency-Key": "has space"})
    A("POST", "/v1/sessions/main/turns", 400, json={}, headers={"Leasehold-Multitask": "later"})
    A("POST", "/v1/sessions/main/turns", 413, content=b"x" * (1024 * 1024 + 1))
    cut = A.cut_off("/v1/sessions/main/turns")
    assert cut.status == 400 and json.loads(cut.body or b"{}")["error"] == "body_read_failed"
    A("POST", "/v1/sessions/main/turns", 502, json={"answer_bytes": MAX_ANSWER_BYTES + 1})
    broke = A(
        "POST", "/v1/sessions/broken/turns", 502, json={"break_once": 1}, headers=key_header("b1")
    )
    assert _error(broke) == "owner_failed"
    # A turn whose every attempt breaks: after --max-turn-attempts (2) it is recorded as
    # failed, and a repeat of its key gets that answer.
    poison = {"break_always": 1}
    A("POST", "/v1/sessions/poison/turns", 502, json=poison, headers=key_header("p1"))
    harness.wait_until(
        lambda: B("GET", "/v1/sessions/poison/turns/p1", 200).json()["state"] == "finished",
        SETTLE_S,
        "the poison turn to be recorded as failed",
    )
    exhausted = C("POST", "/v1/sessions/poison/turns", 502, json=poison, headers=key_header("p1"))
    assert _error(exhausted) == "attempts_exhausted"
    assert exhausted.headers.get("leasehold-replayed") == "true"

    # ---- events: the same doors --------------------------------------------------------
    A("POST", "/v1/sessions/main/events", 200, json={}, headers=key_header("e1"))
    A("POST", "/v1/sessions/main/events", 422, json={"other": 1}, headers=key_header("e1"))
    A("POST", "/v1/sessions/bad%20key/events", 400, json={})
    A("POST", "/v1/sessions/main/events", 413, content=b"x" * (1024 * 1024 + 1))
    A("POST", "/v1/sessions/main/events", 502, json={"answer_bytes": MAX_ANSWER_BYTES + 1})

    # ---- one turn at a time: busy, interrupted, cancelled, queue_full ----------------------
    long_turn = A.background(
        "POST", "/v1/sessions/main/turns", json={"sleep": LONG_TURN_S}, headers=key_header("long-1")
    )
    harness.wait_until(agent_has(a, "long-1"), SETTLE_S, "the agent to get long-1")
    busy = A(
        "POST", "/v1/sessions/main/turns", 409, json={}, headers={"Leasehold-Multitask": "reject"}
    )
    assert busy.json() == {"error": "busy", "turn_id": "long-1"}
    A(
        "POST",
        "/v1/sessions/main/turns",
        200,
        json={},
        headers={"Leasehold-Multitask": "interrupt", "Idempotency-Key": "intr-1"},
    )
    assert long_turn().status_code == 409 and _error(long_turn()) == "interrupted"
    assert (
        _error(
            A(
                "POST",
                "/v1/sessions/main/turns",
                409,
                json={"sleep": LONG_TURN_S},
                headers=key_header("long-1"),
            )
        )
        == "cancelled"
    )
    running = A.background(
        "POST",
        "/v1/sessions/main/turns",
        json={"sleep": SHORT_TURN_S},
        headers=key_header("long-2"),
    )
    harness.wait_until(agent_has(a, "long-2"), SETTLE_S, "the agent to get long-2")
    # Two more while it runs: whichever reaches the owner second finds the queue full.
    more = [
        A.background("POST", "/v1/sessions/main/turns", json={}, headers=key_header(k))
        for k in ("queued-1", "queued-2")
    ]
    outcomes = sorted(
        (r.status_code, "" if r.status_code == 200 else _error(r)) for r in (m() for m in more)
    )
    assert outcomes == [(200, ""), (503, "queue_full")], outcomes
    assert running().status_code == 200
    long_event = A.background(
        "POST",
        "/v1/sessions/main/events",
        json={"sleep": LONG_TURN_S},
        headers=key_header("long-e"),
    )
    harness.wait_until(agent_has(a, "long-e"), SETTLE_S, "the agent to get long-e")
    A("DELETE", "/v1/sessions/main/turns/long-e", 200)
    assert long_event().status_code == 409
    A(
        "POST",
        "/v1/sessions/main/events",
        409,
        json={"sleep": LONG_TURN_S},
        headers=key_header("long-e"),
    )

    # ---- a turn by its id ---------------------------------------------------------------
    B("GET", "/v1/sessions/main/turns/t1", 200)
    B("GET", "/v1/sessions/main/turns/nope", 404)
    B("GET", "/v1/sessions/bad%20key/turns/t1", 400)
    B("DELETE", "/v1/sessions/main/turns/t1", 409)
    B("DELETE", "/v1/sessions/main/turns/nope", 404)
    B("DELETE", "/v1/sessions/bad%20key/turns/t1", 400)

    # ---- the session, the stream --------------------------------------------------------
    C("GET", "/v1/sessions/main", 200)
    C("GET", "/v1/sessions/bad%20key", 400)
    C.stream("/v1/sessions/bad%20key/stream", 400)
    C.stream("/v1/sessions/main/stream?after=yesterday", 400)
    with httpx.stream(
        "GET", f"{a.public_url}/v1/sessions/main/stream", timeout=REQUEST_TIMEOUT_S
    ) as open_stream:
        assert open_stream.status_code == 200
        A.stream("/v1/sessions/main/stream", 503)  # --max-streams-per-session 1
    A.stream("/v1/sessions/main/stream", 200, headers={"Last-Event-ID": f"{epoch}-1"})

    # ---- a turn whose agent answers 409: fenced ------------------------------------------
    fenced = A("POST", "/v1/sessions/fence/turns", json={"status": 409}, headers=key_header("f1"))
    assert fenced.status_code == 503 and _error(fenced) == "fenced", fenced.text
    harness.wait_until(
        lambda: any(
            r.raw_path.endswith("/stand-down") for n in agents.values() for r in n.requests
        ),
        SETTLE_S,
        "a stand-down",
    )
    harness.wait_until(
        lambda: A("DELETE", "/v1/sessions/fence/turns/f1").status_code == 200,
        SETTLE_S,
        "the fenced turn to be cancelled",
    )

    # ---- the agent API ------------------------------------------------------------------
    AA = api[a.name]
    at = {"Leasehold-Epoch": str(epoch)}
    stale = {"Leasehold-Epoch": str(epoch + 7)}
    AA("GET", "/v1/sessions/main/checkpoint", 200)
    AA("GET", "/v1/sessions/never/checkpoint", 404)
    AA("GET", "/v1/sessions/bad%20key/checkpoint", 400)
    AA("PUT", "/v1/sessions/main/checkpoint", 204, content=b"state-2", headers=at)
    AA("PUT", "/v1/sessions/main/checkpoint", 400, content=b"state-2")
    AA("PUT", "/v1/sessions/main/checkpoint", 409, content=b"state-2", headers=stale)
    AA(
        "PUT",
        "/v1/sessions/main/checkpoint",
        413,
        content=b"x" * (16 * 1024 * 1024 + 1),
        headers=at,
    )
    AA("POST", "/v1/sessions/main/events", 202, json={"type": "note", "data": [1]}, headers=at)
    AA("POST", "/v1/sessions/main/events", 400, json={"type": "two\nlines"}, headers=at)
    AA("POST", "/v1/sessions/main/events", 409, json={"type": "note"}, headers=stale)
    AA("POST", "/v1/sessions/main/events", 413, content=b"x" * (1024 * 1024 + 1), headers=at)
    events = AA("GET", "/v1/sessions/main/turns/t1/events", 200).json()
    assert [e["type"] for e in events] == ["token"], events
    AA("GET", "/v1/sessions/main/turns/t1/events", 400, headers={"Leasehold-Epoch": "0"})
    AA("DELETE", "/v1/sessions/main/lease", 400)
    AA("DELETE", "/v1/sessions/main/lease", 409, headers=stale)
    held = A("POST", "/v1/sessions/held/turns", 200, json={})
    released = A("POST", "/v1/sessions/released/turns", 200, json={})
    AA(
        "DELETE",
        "/v1/sessions/released/lease",
        204,
        headers={"Leasehold-Epoch": released.headers["leasehold-epoch"]},
    )

    # ---- every listener: unknown path, wrong method, oversized head, connection cap --------
    A("GET", "/v1/nothing", 404)
    A("GET", "/v1/sessions/main/turns", 405)
    A("GET", "/v1/sessions/main", 431, headers={"X-Big": "x" * (70 * 1024)})
    idle = [socket.create_connection((a.ip, a.ports["public"])) for _ in range(MAX_CONNECTIONS)]
    try:
        over = A("GET", "/v1/sessions/main", 503)
        assert _error(over) == "overloaded" and over.headers.get("connection") == "close"
    finally:
        for s in idle:
            s.close()

    # ---- admin: health, metrics, proofs, a drain that nobody runs ---------------------------
    AD = adm[a.name]
    AD("GET", "/healthz", 200)
    AD("GET", "/readyz", 200)
    AD("GET", "/metrics", 200)
    AD("GET", "/metrics", 200, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    AD("GET", "/leases", 200, headers=proof(cluster.secret, "GET", "/leases", a.name))
    AD("GET", "/leases", 401)
    AD("POST", "/drain", 401)
    AD("GET", "/drained", 503)
    # then_* without the token made for them: refused at once, nothing sleeps.
    AD("GET", "/drained?then_sleep=3600", 401)
    other = drain_hook_token(cluster.secret, None, None, 1)
    AD("GET", "/drained?then_sleep=3600", 401, headers={"Leasehold-Drain-Hook": other})
    AD("GET", "/readyz", 200)

    # ---- a dying owner: a forwarded cancel fails, then its session waits for its lease ---------
    agents[c.name].cancel_delay = LONG_TURN_S
    doomed = C.background(
        "POST",
        "/v1/sessions/doomed/turns",
        json={"sleep": 3 * LONG_TURN_S},
        headers=key_header("d1"),
    )
    harness.wait_until(agent_has(c, "d1"), SETTLE_S, "c's agent to get d1")
    cancel = A.background("DELETE", "/v1/sessions/doomed/turns/d1")
    harness.wait_until(
        lambda: any(r.raw_path.endswith("/d1/cancel") for r in agents[c.name].requests),
        SETTLE_S,
        "the cancel at c",
    )
    c.sidecar.kill9()
    assert _error(cancel()) == "owner_failed"
    # c answers d1's client `interrupted` as the cancel starts, unless it died first.
    with contextlib.suppress(httpx.TransportError):
        assert _error(doomed()) == "interrupted"
    pending = A("POST", "/v1/sessions/doomed/turns", 503, json={}, headers=key_header("d2"))
    assert _error(pending) == "takeover_pending", pending.text

    # ---- a drain: refusals with `draining`, then the report ----------------------------------
    report = adm[b.name](
        "POST", "/drain", 200, headers=proof(cluster.secret, "POST", "/drain", b.name)
    )
    assert set(report.json()) == {"handed_back", "in_flight_finished", "in_flight_stood_down"}
    adm[b.name]("GET", "/drained", 200)
    # The user's hook the token covers runs after the drain: a GET to a closed port fails.
    port = closed_port()
    hook = drain_hook_token(cluster.secret, port, "/x", None)
    hook_path = f"/drained?then_port={port}&then_path=%2Fx"
    failed_hook = adm[b.name]("GET", hook_path, 502, headers={"Leasehold-Drain-Hook": hook})
    assert _error(failed_hook) == "prestop_hook_failed", failed_hook.text
    adm[b.name]("GET", "/readyz", 503)
    for method, path in [
        ("POST", "/v1/sessions/main/turns"),
        ("POST", "/v1/sessions/main/events"),
        ("DELETE", "/v1/sessions/main/turns/t1"),
    ]:
        assert _error(B(method, path, 503, json={} if method == "POST" else None)) == "draining"
    B.stream("/v1/sessions/main/stream", 503)

    # ---- the agent is gone: agent_unavailable ------------------------------------------------
    a.agent.kill9()
    gone = A("POST", "/v1/sessions/main/turns", 503, json={})
    assert _error(gone) == "agent_unavailable", gone.text

    # ---- the database is gone: store_unavailable ---------------------------------------------
    epoch_held = {"Leasehold-Epoch": held.headers["leasehold-epoch"]}
    _drop_database(database_url)
    A("GET", "/v1/sessions/main", 503)
    A("GET", "/v1/sessions/main/turns/t1", 503)
    AA("GET", "/v1/sessions/main/checkpoint", 503)
    AA("GET", "/v1/sessions/main/turns/t1/events", 503)
    AA("PUT", "/v1/sessions/held/checkpoint", 503, headers=epoch_held, content=b"s")
    AA("DELETE", "/v1/sessions/held/lease", 503, headers=epoch_held)
    harness.wait_until(lambda: AD("GET", "/readyz").status_code == 503, SETTLE_S, "a not ready")
    failed = AD("POST", "/drain", headers=proof(cluster.secret, "POST", "/drain", a.name))
    assert failed.status_code == 500, failed.text
    AD("GET", "/drained", 500)

    # ---- what the sidecars sent the agents ----------------------------------------------------
    for agent in agents.values():
        for seen in agent.requests:
            coverage.record_webhook(agent_doc, seen.method, seen.raw_path, seen.headers)

    missing = coverage.missing()
    assert not missing, "documented but never produced:\n" + "\n".join(missing)
