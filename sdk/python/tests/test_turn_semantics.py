"""docs/http-api.md (turn journal, exactly-once, resume, one turn at a time) and the forwarded
client headers of §2/§4, through the SDK against real sidecars.

Each test is marked `awaits_server(feature)` with the server-side feature it needs. The
sidecar implements all of them; a sidecar under test that lacks one (the probe in
`harness.probe_server_features` says so) fails the test, naming what the probe found: it
is never skipped."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

import leasehold
from harness import Cluster, Node, stored_history, wait_until
from leasehold.agent import Session, TurnRequest, create_app


@pytest.mark.awaits_server("idempotency")
def test_a_repeated_idempotency_key_is_answered_once_even_after_a_failover(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(lease_ttl_ms=2000, heartbeat_ms=400)
    key, idem = "exactly-once", "order-7f3a"
    with cluster.client(0) as via_a:
        first = via_a.send_turn(key, {"text": "pay", "tokens": 0}, idempotency_key=idem)
        again = via_a.send_turn(key, {"text": "pay", "tokens": 0}, idempotency_key=idem)
    assert not first.replayed
    assert again.replayed and again.content == first.content
    assert stored_history(cluster.database_url, key) == ["pay"]

    cluster.nodes[0].kill9()  # the pod that ran it dies; the answer was recorded
    with cluster.client(1, 2) as others:
        replayed = others.send_turn(key, {"text": "pay", "tokens": 0}, idempotency_key=idem)
        assert replayed.replayed and replayed.content == first.content
        with pytest.raises(leasehold.IdempotencyKeyReused) as reused:
            others.send_turn(key, {"text": "refund", "tokens": 0}, idempotency_key=idem)
    assert (reused.value.status, reused.value.code) == (422, "idempotency_key_reused")
    assert stored_history(cluster.database_url, key) == ["pay"]


@pytest.mark.awaits_server("turn_journal")
def test_get_turn_reports_a_finished_turn_with_its_answer(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(nodes=1)
    key = "journaled"
    with cluster.client() as client:
        answer = client.send_turn(key, {"text": "hi", "tokens": 0})
        info = client.turn(key, answer.idempotency_key)
        assert client.turn(key, "no-such-turn") is None
    assert info is not None
    assert (info.turn_id, info.state, info.epoch) == (answer.idempotency_key, "finished", 1)
    assert info.finished and info.answer is not None


def _holding_app(
    node: Node, log: queue.Queue[tuple[str, Any]], release: threading.Event
) -> Starlette:
    """Publishes `step1`, `step2`, then holds until `release` (or cancellation)."""

    async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
        body = request.json()
        log.put(("dispatched", (node.name, session.turn_id, session.resume_of)))
        if session.resume_of is not None:
            journal = await session.journal_events()
            log.put(("journal", [e.type for e in journal]))
        else:
            await session.publish("step1", {"turn": session.turn_id})
            await session.publish("step2", {"turn": session.turn_id})
            log.put(("published", session.turn_id))
        try:
            if body.get("hold"):
                await asyncio.to_thread(release.wait, 60)
        except asyncio.CancelledError:
            log.put(("cancelled", session.turn_id))
            raise
        await session.checkpoint({"history": [body.get("text", "")]})
        return {"text": body.get("text"), "node": node.name}

    return create_app(on_turn, sidecar_url=node.agent_api_url)


@pytest.mark.awaits_server("multitask")
def test_multitask_reject_is_busy_and_interrupt_cancels_the_running_turn(
    make_cluster: Callable[..., Cluster],
) -> None:
    log: queue.Queue[tuple[str, Any]] = queue.Queue()
    release = threading.Event()
    cluster = make_cluster(nodes=1, agents={0: lambda node: _holding_app(node, log, release)})
    key = "one-at-a-time"
    outcome: queue.Queue[BaseException | leasehold.TurnResponse] = queue.Queue()

    def long_turn() -> None:
        try:
            with cluster.client() as client:
                outcome.put(client.send_turn(key, {"text": "long", "hold": True}))
        except BaseException as e:
            outcome.put(e)

    try:
        threading.Thread(target=long_turn, daemon=True).start()
        kind, (_, running_id, _) = log.get(timeout=10)
        assert kind == "dispatched"
        assert log.get(timeout=10) == ("published", running_id)
        with cluster.client() as client:
            with pytest.raises(leasehold.Busy) as busy:
                client.send_turn(key, {"text": "rejected"}, multitask="reject")
            assert busy.value.turn_id == running_id
            newer = client.send_turn(key, {"text": "newer"}, multitask="interrupt")
        assert newer.json()["text"] == "newer"
        assert ("cancelled", running_id) in [log.get(timeout=10) for _ in range(3)]
        interrupted = outcome.get(timeout=10)
        assert isinstance(interrupted, leasehold.Interrupted), interrupted
    finally:
        release.set()


@pytest.mark.awaits_server("turn_journal")
def test_a_turn_cut_by_its_owners_death_is_resumed_with_its_journal(
    make_cluster: Callable[..., Cluster],
) -> None:
    log: queue.Queue[tuple[str, Any]] = queue.Queue()
    release = threading.Event()
    cluster = make_cluster(
        lease_ttl_ms=2000,
        heartbeat_ms=400,
        agents={i: (lambda node: _holding_app(node, log, release)) for i in range(3)},
    )
    key = "resumed"
    answer: queue.Queue[BaseException | leasehold.TurnResponse] = queue.Queue()

    def send() -> None:
        try:
            with cluster.client(1) as via_b:  # forwarded to node-a, the owner
                answer.put(via_b.send_turn(key, {"text": "cut", "hold": True}))
        except BaseException as e:
            answer.put(e)

    with cluster.client(0) as via_a:
        via_a.send_turn(key, {"text": "claim"})
    assert [log.get(timeout=5)[0] for _ in range(2)] == ["dispatched", "published"]
    threading.Thread(target=send, daemon=True).start()
    kind, (node, turn_id, resume_of) = log.get(timeout=10)
    assert (kind, node, resume_of) == ("dispatched", "node-a", None)
    assert log.get(timeout=10) == ("published", turn_id)
    # A 202 is not yet durable (events are journaled in group commits); one a watcher
    # received is: the sidecar fans events out only once journaled.
    seen: queue.Queue[str] = queue.Queue()

    def watch() -> None:
        with cluster.client(2) as watcher, watcher.stream(key) as stream:
            for event in stream:
                if isinstance(event.data, dict) and event.data.get("turn") == turn_id:
                    seen.put(event.type)
                    if event.type == "step2":
                        return

    threading.Thread(target=watch, daemon=True).start()
    assert [seen.get(timeout=10) for _ in range(2)] == ["step1", "step2"]
    cluster.nodes[0].sidecar.kill9()  # its agent lives on, cut off: the fence stops it
    try:
        resumed = log.get(timeout=3 * cluster.lease_ttl + 5)  # the new owner re-dispatches
        assert resumed[0] == "dispatched"
        assert resumed[1][1:] == (turn_id, turn_id), "re-dispatched with Leasehold-Resume"
        assert log.get(timeout=10) == ("journal", ["step1", "step2"])
    finally:
        release.set()
    with cluster.client(1, 2) as others:
        info = wait_until(
            lambda: (i := others.turn(key, turn_id)) is not None and i.finished and i,
            15,
            "the resumed turn to finish",
        )
    assert info.epoch == 2


@pytest.mark.awaits_server("forward_headers")
def test_allow_listed_client_headers_reach_the_handler(
    make_cluster: Callable[..., Cluster],
) -> None:
    seen: queue.Queue[TurnRequest] = queue.Queue()

    def app(node: Node) -> Starlette:
        async def on_turn(session: Session, request: TurnRequest) -> None:
            seen.put(request)

        return create_app(on_turn, sidecar_url=node.agent_api_url)

    cluster = make_cluster(nodes=2, agents={0: app, 1: app})
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with cluster.client(0) as via_a:
        via_a.send_turn(
            "headers", {}, headers={"Authorization": "Bearer t0k", "traceparent": trace}
        )
    first = seen.get(timeout=5)
    with httpx.Client() as http:  # across the hop too (node-b forwards to the owner)
        http.post(
            f"{cluster.nodes[1].public_url}/v1/sessions/headers/turns",
            json={},
            headers={"authorization": "Bearer t0k", "x-not-listed": "secret"},
        )
    second = seen.get(timeout=5)
    assert (first.authorization, first.traceparent) == ("Bearer t0k", trace)
    assert second.authorization == "Bearer t0k"
    assert "x-not-listed" not in second.headers
