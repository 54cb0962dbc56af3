/**
 * `client.stream()` against real sidecars: replay after Last-Event-ID, and a stream
 * that survives the drain of the pod it was connected to.
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import type { LeaseholdEvent, ReconnectInfo } from "../src/index.js";
import { Cluster, drain, waitFor, withCluster } from "./support/cluster.js";

type Nodes = Cluster["nodes"];

function strictlyIncreasing(events: LeaseholdEvent[]): void {
  for (let i = 1; i < events.length; i++) {
    const [p, e] = [events[i - 1] as LeaseholdEvent, events[i] as LeaseholdEvent];
    assert.ok(e.epoch > p.epoch || (e.epoch === p.epoch && e.seq > p.seq), `ids out of order: ${p.id} then ${e.id}`);
  }
}

/** Collect a stream in the background until `controller` aborts. */
function collect(stream: AsyncIterable<LeaseholdEvent>): { events: LeaseholdEvent[]; done: Promise<unknown> } {
  const events: LeaseholdEvent[] = [];
  const done = (async () => {
    for await (const event of stream) events.push(event);
  })().catch((error: unknown) => error);
  return { events, done };
}

test("a stream resumes after Last-Event-ID: only the later events of the turn are replayed", async () => {
  await withCluster({}, async (cluster) => {
    const key = "replay";
    const client = cluster.client();
    const controller = new AbortController();
    const live = collect(client.stream(key, { signal: controller.signal }));
    // Wait for the observer to be connected (an idle session announces `idle`) before the turn.
    await waitFor("observer on node-a", async () => (await (cluster.nodes[0] as Nodes[number]).metric("leasehold_observers")) >= 1);
    const answer = await client.sendTurn(key, { text: "one", tokens: 4 });
    assert.equal(answer.status, 200);
    await waitFor("the turn's 6 events", () => live.events.length >= 6);
    controller.abort();
    assert.deepEqual(
      live.events.map((e) => e.type),
      ["turn_started", "token", "token", "token", "token", "turn_finished"],
    );
    strictlyIncreasing(live.events);

    // Resume after the second token, on another node.
    const after = live.events[2] as LeaseholdEvent;
    const resumed: LeaseholdEvent[] = [];
    const again = new AbortController();
    const stream = cluster.client({}, [cluster.nodes[2] as Nodes[number]]).stream(key, { lastEventId: after.id, signal: again.signal });
    for await (const event of stream) {
      resumed.push(event);
      if (event.type === "turn_finished") break;
    }
    assert.deepEqual(
      resumed.map((e) => e.id),
      live.events.slice(3).map((e) => e.id),
      "exactly the events after Last-Event-ID",
    );
  });
});

test("a stream connected to a pod that drains mid-turn reconnects with Last-Event-ID and follows the next owner", async () => {
  await withCluster({ drainTimeoutMs: 800 }, async (cluster) => {
    const [a] = cluster.nodes as [Nodes[number]];
    const key = "drained-stream";
    const first = await cluster.client({}, [a]).sendTurn(key, { text: "one", tokens: 1 });
    assert.equal(first.owner, "node-a");

    // The observer starts on node-a (first in its list); the turn's client too.
    const reconnects: ReconnectInfo[] = [];
    const controller = new AbortController();
    const observer = collect(cluster.client().stream(key, { signal: controller.signal, onReconnect: (i) => reconnects.push(i) }));
    await waitFor("observer on node-a", async () => (await a.metric("leasehold_observers")) >= 1);
    const turn = cluster.client().sendTurn(key, { text: "two", think_ms: 4000, tokens: 8 });

    const isTwo = (e: LeaseholdEvent): boolean => e.type === "turn_started" && (e.data as { text?: string }).text === "two";
    await waitFor("two tokens of the turn on node-a", () => {
      const start = observer.events.findIndex(isTwo);
      return start >= 0 && observer.events.slice(start).filter((e) => e.type === "token").length >= 2;
    });
    const beforeDrain = observer.events.length;
    const report = await drain(a, cluster.secret);
    assert.equal(report.in_flight_stood_down, 1, `the turn outlived the drain timeout: ${JSON.stringify(report)}`);

    // The turn's client obeyed the directives and the next owner resumed the turn.
    const answer = await turn;
    assert.equal(answer.status, 200);
    assert.equal(answer.epoch, 2);
    assert.notEqual(answer.owner, "node-a");
    assert.ok(answer.directives.length > 0, "re-sent by directive");
    assert.equal((await answer.json<{ history_len: number }>()).history_len, 2, "the turn is in the history once");

    await waitFor("the epoch-2 turn_finished on the resumed stream", () => observer.events.some((e) => e.epoch === 2 && e.type === "turn_finished"));
    controller.abort();
    assert.ok(reconnects.length >= 1, "the stream reconnected");
    const firstReconnect = reconnects[0] as ReconnectInfo;
    assert.equal(firstReconnect.reason, "reconnect", "node-a said `reconnect` as it drained");
    assert.ok(observer.events.length >= beforeDrain);
    const lastBefore = observer.events.filter((e) => e.epoch === 1).at(-1) as LeaseholdEvent;
    assert.equal(firstReconnect.lastEventId, lastBefore.id, "reconnected with the last id it had");
    assert.notEqual(firstReconnect.baseUrl, a.publicUrl, "to another node");
    strictlyIncreasing(observer.events);
    // The interrupted attempt's events once, then turn_resumed, then only the rest.
    const indexes = (events: LeaseholdEvent[]): number[] =>
      events.filter((e) => e.type === "token").map((e) => (e.data as { i: number }).i);
    const start = observer.events.findIndex(isTwo);
    const firstAttempt = indexes(observer.events.slice(start).filter((e) => e.epoch === 1));
    const second = observer.events.filter((e) => e.epoch === 2);
    assert.ok(firstAttempt.length >= 2, `tokens of the first attempt: ${firstAttempt.join(",")}`);
    assert.deepEqual(
      second.map((e) => e.type),
      ["turn_resumed", ...Array<string>(8 - firstAttempt.length).fill("token"), "turn_finished"],
      "no second turn_started, only the tokens not yet published",
    );
    assert.deepEqual([...firstAttempt, ...indexes(second)], [0, 1, 2, 3, 4, 5, 6, 7], "every token once, in order");
    assert.deepEqual(second.at(-1)?.data, { history_len: 2 });
  });
});
