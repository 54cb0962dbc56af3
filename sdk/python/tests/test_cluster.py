"""The client and the Python reference agent against real sidecars (3 pods, one Postgres)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import leasehold
from harness import Cluster, lease_epoch, stored_history, wait_until

#: Scheduling slack on top of a bound derived from the lease TTL (2 cores, many processes).
SLACK = 3.0


def short_leases() -> dict[str, int]:
    """A 2 s lease renewed every 400 ms (as localcluster's short_lease_options)."""
    return {"lease_ttl_ms": 2000, "heartbeat_ms": 400}


class Recorder:
    """httpx event hooks that record every request a client sends (method, URL, headers):
    a real client on the real network, observed."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self._lock = threading.Lock()

    def hook(self, request: httpx.Request) -> None:
        with self._lock:
            self.requests.append(request)

    def client(self, urls: list[str], **options: Any) -> leasehold.Client:
        http = httpx.Client(
            timeout=httpx.Timeout(120.0, connect=1.0), event_hooks={"request": [self.hook]}
        )
        return leasehold.Client(urls, http_client=http, **options)

    def posts(self) -> list[httpx.Request]:
        return [r for r in self.requests if r.method == "POST"]


def test_turns_through_three_pods_end_on_one_owner(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    key = "three-pods"
    answers = []
    for i in range(6):
        node = cluster.nodes[i % 3]
        with cluster.client(i % 3) as client:  # one pod's URL only: that pod routes the turn
            answer = client.send_turn(key, {"text": f"t{i}", "tokens": 1})
        answers.append((node.name, answer))
    owners = {a.owner for _, a in answers}
    assert len(owners) == 1, f"every turn ran on one owner: {owners}"
    owner = owners.pop()
    assert owner in {n.name for n in cluster.nodes}
    for i, (entered, answer) in enumerate(answers):
        body = answer.json()
        assert answer.status == 200
        assert answer.epoch == 1, f"turn {i} entered at {entered}: no takeover"
        assert body == {"history_len": i + 1, "epoch": 1, "node": owner}, body
        assert answer.directives == []
        assert answer.url == cluster.nodes[i % 3].public_url
    assert stored_history(cluster.database_url, key) == [f"t{i}" for i in range(6)]
    # Every pod's view agrees; a read is never a claim.
    for i in range(3):
        with cluster.client(i) as client:
            info = client.session(key)
        assert (info.key, info.owner, info.epoch, info.claimable) == (key, owner, 1, False)
        assert info.expires_in_ms is not None and 0 < info.expires_in_ms <= 3000
    with cluster.client() as client:
        unknown = client.session("never-used")
    assert (unknown.owner, unknown.epoch, unknown.claimable) == (None, None, True)


def test_events_reach_the_agent_and_bad_input_is_typed(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(nodes=1)
    key = "events"
    with cluster.client() as client:
        turn = client.send_turn(key, {"text": "hello", "tokens": 0})
        event = client.send_event(key, {"name": "webhook"})
        assert event.json()["history_len"] == 2
        assert turn.idempotency_key != event.idempotency_key
        # The agent's own refusal comes back as it answered, typed by its code.
        with pytest.raises(leasehold.HttpError) as bad:
            client.send_turn(key, b"{not json", content_type="application/json")
        assert (bad.value.status, bad.value.code) == (400, "malformed_json")
        with pytest.raises(ValueError, match="invalid session key"):
            client.send_turn("no/slash", {})
    assert stored_history(cluster.database_url, key) == ["hello", "event:webhook"]


def test_a_directive_is_honoured_across_a_kill9_of_the_owner(
    make_cluster: Callable[..., Cluster],
) -> None:
    # The TTL path (a pod lost with its network): with connection liveness on, Postgres sees
    # a killed sidecar's connection close and its sessions move with no directive at all.
    cluster = make_cluster(**short_leases(), sidecar_args=["--connection-liveness=false"])
    key = "crash"
    with cluster.client(0) as client:
        first = client.send_turn(key, {"text": "before", "tokens": 1})
    assert (first.owner, first.epoch) == ("node-a", 1)

    cluster.nodes[0].kill9()
    killed = time.monotonic()
    recorder = Recorder()
    # node-a first: its port refuses (nothing sent), so the client moves on by itself.
    with recorder.client(cluster.public_urls) as client:
        answer = client.send_turn(key, {"text": "after", "tokens": 1})
    took = time.monotonic() - killed

    assert answer.status == 200
    assert answer.owner in ("node-b", "node-c"), answer.owner
    assert answer.epoch == 2, "taken over with epoch + 1"
    assert answer.json() == {"history_len": 2, "epoch": 2, "node": answer.owner}
    assert answer.directives, "the owner's lease was still live: the client was told to wait"
    assert set(answer.directives) <= {"takeover_pending", "owner_unreachable"}, answer.directives
    assert took <= cluster.lease_ttl + len(answer.directives) * 1.0 + SLACK, took
    posts = recorder.posts()
    assert len(posts) >= len(answer.directives) + 1
    keys = {r.headers["idempotency-key"] for r in posts}
    turn_ids = {r.headers["leasehold-turn-id"] for r in posts}
    assert keys == {answer.idempotency_key}, "every attempt carries the turn's one key"
    assert turn_ids == {answer.idempotency_key}
    assert stored_history(cluster.database_url, key) == ["before", "after"]
    assert lease_epoch(cluster.database_url, key) == 2


def test_a_drained_pod_exhausts_the_draining_budget(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(nodes=2, drain_timeout_ms=1500)
    report = cluster.nodes[0].drain()
    assert report == {"handed_back": 0, "in_flight_finished": 0, "in_flight_stood_down": 0}
    recorder = Recorder()
    started = time.monotonic()
    with (
        recorder.client([cluster.nodes[0].public_url]) as client,
        pytest.raises(leasehold.RetryBudgetExhausted) as gave_up,
    ):
        client.send_turn("drained", {"text": "x"})
    waited = time.monotonic() - started
    error = gave_up.value
    assert (error.status, error.code) == (503, "draining")
    assert error.directive is not None and error.directive.budget_ms == 1500
    assert set(error.directives) == {"draining"} and len(error.directives) >= 2
    # Re-sent after each delay until the next one would overrun the budget, no longer.
    assert 1.5 - error.directive.delay - 0.1 <= waited <= 1.5 + SLACK, waited
    assert len(recorder.posts()) == len(error.directives)
    assert len({r.headers["idempotency-key"] for r in recorder.posts()}) == 1

    # The asyncio client obeys the same directives and gives up the same way.
    async def async_attempt() -> leasehold.RetryBudgetExhausted:
        async with leasehold.AsyncClient(cluster.nodes[0].public_url) as client:
            with pytest.raises(leasehold.RetryBudgetExhausted) as gave_up:
                await client.send_turn("drained", {"text": "x"})
        return gave_up.value

    started = time.monotonic()
    async_error = asyncio.run(async_attempt())
    assert async_error.code == "draining" and len(async_error.directives) >= 2
    assert time.monotonic() - started >= 1.5 - error.directive.delay - 0.1
    # The other pod serves it at once.
    with cluster.client(1) as client:
        assert client.send_turn("drained", {"text": "x"}).owner == "node-b"


def test_owner_failed_is_retried_with_its_key_unless_turned_off(
    make_cluster: Callable[..., Cluster],
) -> None:
    """A turn forwarded to a frozen owner is `502 owner_failed` once the owner's lease
    lapses (it may have run). The client re-sends it with the same key and the takeover
    serves it; with `retry_owner_failed=False` it raises `OwnerFailed` after one request."""
    cluster = make_cluster(**short_leases())
    a = cluster.nodes[0]
    others = [cluster.nodes[1].public_url, cluster.nodes[2].public_url]

    def freeze_owning(key: str) -> None:
        with cluster.client(0) as via_a:
            assert via_a.send_turn(key, {"text": "first", "tokens": 0}).owner == "node-a"
        a.sidecar.pause()
        a.agent.pause()

    def thaw() -> None:
        a.sidecar.resume()
        a.agent.resume()

    freeze_owning("retried")
    try:
        recorder = Recorder()
        # Retries bounded by the budget here, not the default count: the takeover waits
        # for the frozen owner's lease to lapse.
        with recorder.client(others, owner_failed_retries=1000) as client:
            answer = client.send_turn("retried", {"text": "again", "tokens": 0})
    finally:
        thaw()
    assert (answer.status, answer.epoch) == (200, 2)
    assert "owner_failed" in answer.directives, answer.directives
    posts = recorder.posts()
    assert len(posts) >= 2
    assert {r.headers["idempotency-key"] for r in posts} == {answer.idempotency_key}
    assert stored_history(cluster.database_url, "retried") == ["first", "again"], "ran once"

    a.wait_ready()  # node-a rejoins with a new boot
    freeze_owning("not-retried")
    try:
        recorder = Recorder()
        with (
            recorder.client(others, retry_owner_failed=False) as client,
            pytest.raises(leasehold.OwnerFailed) as failed,
        ):
            client.send_turn("not-retried", {"text": "into the freeze", "tokens": 0})
    finally:
        thaw()
    assert (failed.value.status, failed.value.code) == (502, "owner_failed")
    assert failed.value.directive is None
    assert len(recorder.posts()) == 1, "turned off: the client invents no retry"
    assert stored_history(cluster.database_url, "not-retried") == ["first"]


def test_a_stream_resumes_with_last_event_id_after_its_pod_is_drained(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster()
    key = "watched"
    b = cluster.nodes[1]
    with cluster.client(1) as client:
        assert client.send_turn(key, {"text": "one", "tokens": 0}).owner == "node-b"

    seen: list[leasehold.Event] = []
    failure: list[BaseException] = []
    client = leasehold.Client([n.public_url for n in cluster.nodes])  # node-a first
    stream = client.stream(key)

    def observe() -> None:
        try:
            for event in stream:
                seen.append(event)
                if event.type == "turn_finished" and event.data == {"history_len": 2}:
                    return
        except BaseException as e:
            failure.append(e)

    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    # The replay of the last turn arrives first: the stream is live on node-a.
    wait_until(lambda: any(e.type == "turn_finished" for e in seen), 15, "the replay")
    assert stream.connections[0][0] == cluster.nodes[0].public_url

    tokens = 20
    long_turn = threading.Thread(
        target=lambda: leasehold.Client([b.public_url]).send_turn(
            key, {"text": "two", "tokens": tokens, "think_ms": 2000}
        ),
        daemon=True,
    )
    long_turn.start()
    wait_until(lambda: sum(e.type == "token" for e in seen) >= 3, 15, "the first tokens")
    report = cluster.nodes[0].drain()  # the stream's pod: it says `reconnect` and closes
    assert report["handed_back"] == 0
    observer.join(timeout=30)
    long_turn.join(timeout=30)
    stream.close()
    client.close()
    assert not failure, failure
    assert not observer.is_alive(), f"the stream did not finish the turn: {seen}"

    # Resumed elsewhere with the last id it had: every event once, in order.
    assert len(stream.connections) >= 2, stream.connections
    resumed_at, resumed_after = stream.connections[1]
    assert resumed_at != cluster.nodes[0].public_url
    assert resumed_after is not None
    published = [e for e in seen if not e.control]
    ids = [(e.epoch, e.seq) for e in published]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    turn_two = published[[e.type for e in published].index("turn_started", 1) :]
    assert [e.type for e in turn_two] == ["turn_started"] + ["token"] * tokens + ["turn_finished"]
    assert [e.data["i"] for e in turn_two if e.type == "token"] == list(range(tokens))
    assert resumed_after in {e.id for e in turn_two}, "it resumed mid-turn"
