"""`leasehold.agent` against real sidecars: the handler's `Session` (thaw, fenced
checkpoint and publish, release), stand-down as cancellation, and a zombie's write
surfaced as `Fenced`. Agents whose insides a test must see run in this process (uvicorn
in a thread) as the agent of a real sidecar."""

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
from harness import Cluster, Node, lapsed, stored_checkpoint, stored_history, wait_until
from leasehold.agent import Session, TurnRequest, create_app

SLACK = 3.0


def test_a_handler_thaws_publishes_and_checkpoints_through_its_sidecar(
    make_cluster: Callable[..., Cluster],
) -> None:
    seen: queue.Queue[dict[str, Any]] = queue.Queue()

    def app(node: Node) -> Starlette:
        async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
            before = await session.thaw_json()
            count = (before or {"count": 0})["count"] + 1
            event_id = await session.publish("step", {"kind": request.kind, "count": count})
            await session.checkpoint({"count": count})
            seen.put(
                {
                    "key": session.key,
                    "epoch": session.epoch,
                    "turn_id": session.turn_id,
                    "resume_of": session.resume_of,
                    "kind": request.kind,
                    "content_type": request.content_type,
                    "body": request.json(),
                    "before": before,
                    "checkpoint_epoch": session.checkpoint_epoch,
                    "headers": dict(request.headers),
                }
            )
            return {"count": count, "event_id": event_id}

        return create_app(on_turn, sidecar_url=node.agent_api_url)

    cluster = make_cluster(nodes=1, agents={0: app})
    key = "handled"

    async def run() -> None:
        async with leasehold.AsyncClient(cluster.public_urls) as client:
            stream = client.stream(key)
            first = await client.send_turn(key, {"text": "one"})
            second = await client.send_event(key, {"name": "hook"}, idempotency_key="evt-42")
            events = []
            async for event in stream:  # connects now: the replay of what was published
                events.append(event)
                if len(events) == 2:
                    break
            await stream.aclose()
        assert first.json() == {"count": 1, "event_id": "1-1"}
        assert second.json() == {"count": 2, "event_id": "1-2"}
        assert (first.owner, first.epoch, second.epoch) == ("node-a", 1, 1)
        assert [(e.id, e.type, e.data) for e in events] == [
            ("1-1", "step", {"kind": "turn", "count": 1}),
            ("1-2", "step", {"kind": "event", "count": 2}),
        ]

        one, two = seen.get(timeout=5), seen.get(timeout=5)
        assert (one["key"], one["epoch"], one["kind"], one["before"]) == (key, 1, "turn", None)
        assert one["turn_id"] == first.idempotency_key, "the client's key is the turn id"
        assert one["resume_of"] is None
        assert one["content_type"] == "application/json"
        assert one["body"] == {"text": "one"}
        assert (two["kind"], two["before"], two["checkpoint_epoch"]) == ("event", {"count": 1}, 1)
        assert two["turn_id"] == "evt-42", "the client's Idempotency-Key is the turn id"
        assert not any(h.startswith("leasehold-") for h in one["headers"]), one["headers"]

    asyncio.run(run())
    stored = stored_checkpoint(cluster.database_url, key)
    assert stored == (1, b'{"count": 2}')


def test_session_writes_with_a_stale_epoch_are_fenced_and_release_frees_the_lease(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(nodes=1)
    node = cluster.nodes[0]
    key = "direct"
    with cluster.client() as client:
        first = client.send_turn(key, {"text": "a", "tokens": 0})
        assert first.epoch == 1

    async def run() -> None:
        held = Session(key, 1, sidecar=node.agent_api_url)
        stale = Session(key, 2, sidecar=node.agent_api_url)  # an epoch this node never held
        try:
            # The demo agent's checkpoint names the turn that wrote it (for a resume): the
            # client's key, a uuid4, is the turn id.
            last_turn = first.idempotency_key
            assert await held.thaw_json() == {"history": ["a"], "last_turn": last_turn}
            assert held.checkpoint_epoch == 1
            event_id = await held.publish("note", {"x": 1})
            assert event_id.startswith("1-")
            with pytest.raises(leasehold.Fenced) as fenced:
                await stale.checkpoint({"history": ["stale"]})
            assert (fenced.value.status, fenced.value.code) == (409, "fenced")
            assert stale.fenced
            with pytest.raises(leasehold.Fenced):
                await stale.publish("note", {"x": 2})  # refused without a round trip
            await held.checkpoint({"history": ["a", "direct"]})
            await held.release()
            with pytest.raises(leasehold.Fenced):  # released: the epoch is over
                await held.checkpoint({"history": ["late"]})
        finally:
            await held.sidecar.aclose()
            await stale.sidecar.aclose()

    asyncio.run(run())
    with cluster.client() as client:
        info = client.session(key)
        assert (info.owner, info.claimable) == (None, True)
        again = client.send_turn(key, {"text": "b", "tokens": 0})
    assert (again.epoch, again.json()["history_len"]) == (2, 3)
    assert stored_history(cluster.database_url, key) == ["a", "direct", "b"]


def test_a_stand_down_cancels_the_running_handler(make_cluster: Callable[..., Cluster]) -> None:
    started = threading.Event()
    outcome: queue.Queue[str] = queue.Queue()
    stood_down: queue.Queue[str] = queue.Queue()

    def app(node: Node) -> Starlette:
        async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
            await session.publish("turn_started", {})
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                outcome.put("cancelled")
                raise
            outcome.put("finished")
            return {}

        return create_app(on_turn, on_stand_down=stood_down.put, sidecar_url=node.agent_api_url)

    cluster = make_cluster(nodes=1, drain_timeout_ms=1000, agents={0: app})
    node = cluster.nodes[0]
    key = "stood-down"
    answer: queue.Queue[httpx.Response] = queue.Queue()
    sender = threading.Thread(
        target=lambda: answer.put(
            httpx.post(f"{node.public_url}/v1/sessions/{key}/turns", json={}, timeout=30)
        ),
        daemon=True,
    )
    sender.start()
    assert started.wait(10)
    # The drain waits 1 s for the turn, then stands the session down: the agent is told.
    report = node.drain()
    assert report == {"handed_back": 1, "in_flight_finished": 0, "in_flight_stood_down": 1}
    assert outcome.get(timeout=10) == "cancelled"
    assert stood_down.get(timeout=10) == key
    response = answer.get(timeout=10)
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "fenced", "halted before any checkpoint: retry elsewhere"


def test_a_zombie_checkpoint_after_sigstop_past_the_ttl_is_fenced(
    make_cluster: Callable[..., Cluster],
) -> None:
    """node-a's sidecar freezes mid-turn for longer than the lease; node-b takes the
    session over and resumes the interrupted turn (once, before its own first turn); the
    handler on node-a then checkpoints (the write sent while its sidecar is frozen,
    answered when it thaws): `Fenced`, and nothing of it lands."""
    ready, go, writing = threading.Event(), threading.Event(), threading.Event()
    write_outcome: queue.Queue[BaseException | None] = queue.Queue()

    def app(node: Node) -> Starlette:
        async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
            body = request.json()
            state = await session.thaw_json() or {"history": []}
            state["history"].append(body["text"])
            if body.get("hold"):
                ready.set()
                await asyncio.to_thread(go.wait, 60)
                write = asyncio.ensure_future(session.checkpoint(state))
                write.add_done_callback(
                    lambda f: write_outcome.put(None if f.cancelled() else f.exception())
                )
                writing.set()
                await asyncio.shield(write)  # a stand-down may cancel us: the write goes on
            else:
                await session.checkpoint(state)
            return {"history_len": len(state["history"]), "epoch": session.epoch}

        return create_app(on_turn, sidecar_url=node.agent_api_url)

    cluster = make_cluster(lease_ttl_ms=2000, heartbeat_ms=400, agents={0: app})
    a = cluster.nodes[0]
    key = "zombie"
    with cluster.client(0) as client:
        assert client.send_turn(key, {"text": "first"}).epoch == 1

    zombie_answer: queue.Queue[httpx.Response] = queue.Queue()
    threading.Thread(
        target=lambda: zombie_answer.put(
            httpx.post(
                f"{a.public_url}/v1/sessions/{key}/turns",
                json={"text": "zombie", "hold": True},
                timeout=60,
            )
        ),
        daemon=True,
    ).start()
    assert ready.wait(10), "the held turn started on node-a"
    a.sidecar.pause()
    try:
        with cluster.client(1, 2) as others:
            # A turn sent now would be forwarded into the freeze (owner_failed): wait until
            # node-a's lease lapsed, as seen from the others (a read, never a claim).
            wait_until(
                lambda: lapsed(others.session(key), "node-a"), 3 * cluster.lease_ttl, "the lapse"
            )
            after = others.send_turn(key, {"text": "after", "tokens": 0})
        assert (after.status, after.epoch) == (200, 2)
        assert after.owner in ("node-b", "node-c")
        go.set()
        assert writing.wait(10), "the zombie's handler sent its checkpoint"
    finally:
        go.set()
        a.sidecar.resume()

    error = write_outcome.get(timeout=20)
    assert isinstance(error, leasehold.Fenced), f"the zombie's write: {error!r}"
    assert (error.status, error.code) == (409, "fenced")
    response = zombie_answer.get(timeout=20)
    assert response.status_code in (502, 503), response.text
    assert response.status_code != 200
    # "zombie" is in the history once: node-b's resume of the turn (its default agent),
    # not node-a's fenced write.
    assert stored_history(cluster.database_url, key) == ["first", "zombie", "after"]
    stored = stored_checkpoint(cluster.database_url, key)
    assert stored is not None and stored[0] == 2
    wait_until(
        lambda: a.metric("leasehold_fenced_writes_total") >= 1, 10, "node-a to count the fence"
    )
