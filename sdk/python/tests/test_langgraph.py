"""`leasehold.langgraph.LeaseholdSaver` against real sidecars: graph state that follows
the session across pods, graph steps streamed to observers, and a zombie's graph step
refused by the fence."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import queue
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import httpx
import pytest

import leasehold
from harness import (
    EXAMPLES,
    Cluster,
    langgraph_agent_argv,
    lapsed,
    stored_checkpoint,
    wait_until,
)
from leasehold.agent import Session
from leasehold.langgraph import LeaseholdSaver


def example() -> ModuleType:
    """examples/langgraph_agent.py, imported (its graph is what the agents run)."""
    spec = importlib.util.spec_from_file_location(
        "langgraph_agent", EXAMPLES / "langgraph_agent.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["langgraph_agent"] = module
    spec.loader.exec_module(module)
    return module


def blob(cluster: Cluster, key: str) -> dict[str, Any]:
    stored = stored_checkpoint(cluster.database_url, key)
    assert stored is not None
    doc: dict[str, Any] = json.loads(stored[1])
    return doc


def test_graph_state_follows_the_session_across_pods_and_steps_reach_observers(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(default_agent=langgraph_agent_argv)
    key = "graph"
    updates: list[leasehold.Event] = []
    with cluster.client(0) as via_a:
        one = via_a.send_turn(key, {"text": "one"}).json()
        two = via_a.send_turn(key, {"text": "two"}).json()
        # The graph's steps were published as they ran: one event per node of each turn.
        with via_a.stream(key, last_event_id="1-0") as stream:
            for event in stream:
                updates.append(event)
                if len(updates) == 4:
                    break
    assert one == {"count": 1, "messages": ["one", "echo:one"], "epoch": 1, "node": "node-a"}
    assert two["count"] == 2 and two["messages"][-2:] == ["two", "echo:two"]
    assert [e.type for e in updates] == ["graph_updates"] * 4
    assert [next(iter(e.data)) for e in updates] == ["count", "echo"] * 2
    assert updates[3].data == {"echo": {"messages": ["echo:two"]}}

    doc = blob(cluster, key)
    assert (doc["format"], doc["version"], doc["thread_id"]) == ("leasehold.langgraph", 1, key)
    assert len(doc["namespaces"][""]) >= 6, "input + one per step, each turn"

    # node-a drains: the next turn runs elsewhere, from the checkpoint node-a's graph wrote.
    assert cluster.nodes[0].drain()["handed_back"] == 1
    with cluster.client(1, 2) as others:
        three = others.send_turn(key, {"text": "three"}).json()
    assert three["node"] in ("node-b", "node-c") and three["epoch"] == 2
    assert three["count"] == 3
    assert three["messages"] == ["one", "echo:one", "two", "echo:two", "three", "echo:three"]
    assert blob(cluster, key)["namespaces"][""], "still one blob, now written at epoch 2"
    assert stored_checkpoint(cluster.database_url, key)[0] == 2  # type: ignore[index]


def test_a_zombie_graph_step_is_refused_by_the_fence(make_cluster: Callable[..., Cluster]) -> None:
    """node-a's whole pod freezes mid-graph (the echo node thinking; the count step's
    checkpoint already stored, legitimately); node-b takes the session over, resumes the
    interrupted turn from that step (its echo runs once, at epoch 2) and then runs the
    next turn; node-a wakes and its echo step is fenced: it never lands. Then a graph run
    with a saver at the old epoch, here in the test, gets `Fenced` on its first step and
    the stored blob does not change by a byte."""
    cluster = make_cluster(default_agent=langgraph_agent_argv, lease_ttl_ms=2000, heartbeat_ms=400)
    a = cluster.nodes[0]
    key = "graph-zombie"
    with cluster.client(0) as via_a:
        assert via_a.send_turn(key, {"text": "first"}).json()["count"] == 1

    zombie: queue.Queue[httpx.Response] = queue.Queue()
    threading.Thread(
        target=lambda: zombie.put(
            httpx.post(
                f"{a.public_url}/v1/sessions/{key}/turns",
                json={"text": "zombie", "think_ms": 1500},
                timeout=60,
            )
        ),
        daemon=True,
    ).start()
    # The turn is in its echo node (count's checkpoint stored) when the pod freezes.
    wait_until(lambda: latest_values(cluster, key)["count"] == 2, 10, "the count step stored")
    a.sidecar.pause()
    a.agent.pause()
    try:
        with cluster.client(1, 2) as others:
            wait_until(
                lambda: lapsed(others.session(key), "node-a"), 3 * cluster.lease_ttl, "the lapse"
            )
            after = others.send_turn(key, {"text": "after"})
        assert after.epoch == 2
        # The frozen turn was resumed from its stored count step, not run again.
        assert after.json()["count"] == 3, "it went on from the frozen turn's stored step"
    finally:
        a.sidecar.resume()
        a.agent.resume()
    response = zombie.get(timeout=30)
    assert response.status_code in (502, 503), response.text
    before = stored_checkpoint(cluster.database_url, key)
    assert before is not None and before[0] == 2

    async def zombie_run() -> None:
        session = Session(key, 1, sidecar=a.agent_api_url)
        saver = LeaseholdSaver.for_session(session)
        try:
            state = await saver.aget_tuple(saver.config)  # reads are not fenced
            assert state is not None
            assert state.checkpoint["channel_values"]["count"] == 3
            graph = example().build_graph().compile(checkpointer=saver)
            with pytest.raises(leasehold.Fenced):
                await graph.ainvoke({"messages": ["late"], "think_ms": 0}, saver.config)
            assert session.fenced
        finally:
            await session.sidecar.aclose()

    asyncio.run(zombie_run())
    assert stored_checkpoint(cluster.database_url, key) == before, "nothing of the zombie landed"
    messages = latest_values(cluster, key)["messages"]
    # "echo:zombie" is the resumed attempt's (epoch 2), once; the zombie's never landed.
    assert messages == ["first", "echo:first", "zombie", "echo:zombie", "after", "echo:after"]
    assert "late" not in messages


def latest_values(cluster: Cluster, key: str) -> dict[str, Any]:
    """The newest root checkpoint's channel values, read the way the saver does (a read:
    any epoch may read)."""

    async def read() -> dict[str, Any]:
        session = Session(key, 1, sidecar=cluster.nodes[1].agent_api_url)
        saver = LeaseholdSaver.for_session(session)
        try:
            state = await saver.aget_tuple(saver.config)
        finally:
            await session.sidecar.aclose()
        assert state is not None
        return dict(state.checkpoint["channel_values"])

    return asyncio.run(read())


def test_the_saver_keeps_the_latest_checkpoints_with_their_writes(
    make_cluster: Callable[..., Cluster],
) -> None:
    """The saver's own API on a real session: list/filter/before/limit, pending writes,
    pruning to `max_checkpoints`, and a checkpoint that is not the saver's is refused."""
    cluster = make_cluster(nodes=1)
    node = cluster.nodes[0]
    with cluster.client() as client:
        for key in ("saver", "foreign"):
            assert client.send_turn(key, {"text": "claim", "tokens": 0}).epoch == 1
    graph_module = example()

    async def run() -> None:
        session = Session("saver", 1, sidecar=node.agent_api_url)
        try:
            saver = LeaseholdSaver(session, max_checkpoints=5)
            # The demo agent's turn left its own checkpoint: the saver refuses to read it…
            with pytest.raises(ValueError, match=r"not a leasehold\.langgraph blob"):
                await saver.aget_tuple(saver.config)
            # …until the thread is deleted (a fenced write of an empty blob).
            await saver.adelete_thread("saver")
            assert [t async for t in saver.alist(None)] == []
            graph = graph_module.build_graph().compile(checkpointer=saver)
            for text in ("a", "b", "c"):
                await graph.ainvoke({"messages": [text], "think_ms": 0}, saver.config)
            listed = [t async for t in saver.alist(saver.config)]
            assert len(listed) == 5, "pruned to the latest 5"
            ids = [t.config["configurable"]["checkpoint_id"] for t in listed]
            assert ids == sorted(ids, reverse=True), "newest first"
            latest = await saver.aget_tuple(saver.config)
            assert latest is not None and latest.checkpoint["channel_values"]["count"] == 3
            assert latest.metadata["step"] == listed[0].metadata["step"]
            loops = [t async for t in saver.alist(saver.config, filter={"source": "loop"}, limit=2)]
            assert len(loops) == 2 and all(t.metadata["source"] == "loop" for t in loops)
            older = [t async for t in saver.alist(saver.config, before=listed[1].config)]
            assert [t.config for t in older] == [t.config for t in listed[2:]]
            # A fresh saver (the next turn) reads back what this one stored.
            again = LeaseholdSaver(Session("saver", 1, sidecar=node.agent_api_url))
            fresh = await again.aget_tuple(saver.config)
            assert fresh is not None and fresh.checkpoint == latest.checkpoint
            reread = [t async for t in again.alist(saver.config)]
            assert [t.pending_writes for t in reread] == [t.pending_writes for t in listed]
            assert any(t.pending_writes for t in listed), "the tasks' writes were kept"
            assert [t.parent_config for t in reread] == [t.parent_config for t in listed]
            with pytest.raises(ValueError, match="thread_id"):
                await again.aget_tuple({"configurable": {"thread_id": "another"}})
            await again.session.sidecar.aclose()

            foreign = LeaseholdSaver(Session("foreign", 1, sidecar=node.agent_api_url))
            with pytest.raises(ValueError, match=r"not a leasehold\.langgraph blob"):
                await foreign.aget_tuple(foreign.config)
            await foreign.session.sidecar.aclose()
        finally:
            await session.sidecar.aclose()

    asyncio.run(run())
    doc = blob(cluster, "saver")
    assert len(doc["namespaces"][""]) == 5
