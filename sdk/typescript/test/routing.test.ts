/**
 * The client against three real sidecars, each with the TypeScript demo agent.
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, ConnectionError, RetryBudgetExhausted } from "../src/index.js";
import { Cluster, MINIMAL_AGENT_JS, PUBLIC_PORT, drain, nextIp, withCluster } from "./support/cluster.js";

interface DemoAnswer {
  history_len: number;
  epoch: number;
  node: string;
}

test("turns sent round robin through three pods all end on one owner, history intact", async () => {
  await withCluster({}, async (cluster) => {
    const client = cluster.client();
    const key = "routing-one-owner";
    const owners = new Set<string>();
    const via = new Set<string>();
    for (let i = 1; i <= 6; i++) {
      const answer = await client.sendTurn(key, { text: `t${i}`, tokens: 1 });
      assert.equal(answer.status, 200);
      const body = await answer.json<DemoAnswer>();
      assert.equal(body.history_len, i, "each turn sees every earlier one");
      assert.equal(body.epoch, 1, "no takeover among live pods");
      assert.equal(answer.epoch, 1);
      assert.equal(answer.owner, body.node, "Leasehold-Owner names the node whose agent answered");
      assert.deepEqual(answer.directives, []);
      owners.add(body.node);
      via.add(answer.baseUrl);
    }
    assert.equal(via.size, 3, "the client used every pod");
    assert.equal(owners.size, 1, `one owner, got ${[...owners].join(", ")}`);
    const info = await client.session(key);
    assert.equal(info.owner, [...owners][0]);
    assert.equal(info.epoch, 1);
    assert.equal(info.claimable, false);
    assert.ok(info.expiresInMs !== null && info.expiresInMs > 0);

    // Events are routed the same way and land in the same history.
    const event = await client.sendEvent(key, { name: "webhook" });
    assert.equal((await event.json<DemoAnswer>()).history_len, 7);
    assert.equal(event.owner, info.owner);
  });
});

test("a refused connection tries the next node; all refused is ConnectionError(unreachable)", async () => {
  await withCluster({ nodes: 1 }, async (cluster) => {
    const dead = `http://${nextIp()}:${PUBLIC_PORT}`; // nothing listens there
    const client = new Client([dead, cluster.nodes[0]?.publicUrl ?? ""]);
    const answer = await client.sendTurn("refused-next", { text: "x", tokens: 0 });
    assert.equal(answer.status, 200);
    assert.equal(answer.baseUrl, cluster.nodes[0]?.publicUrl);

    const nobody = new Client([dead, `http://${nextIp()}:${PUBLIC_PORT}`]);
    await assert.rejects(nobody.sendTurn("refused-all", { text: "x" }), (error: unknown) => {
      assert.ok(error instanceof ConnectionError);
      assert.equal(error.code, "unreachable");
      return true;
    });
  });
});

test("a directive is honoured across a kill -9 of the owner: same turn served by the next owner", async () => {
  // The TTL path (a pod lost with its network): with connection liveness on, Postgres sees a
  // killed sidecar's connection close and its sessions move with no directive at all.
  const sidecarArgs = ["--connection-liveness=false"];
  await withCluster({ leaseTtlMs: 2000, heartbeatMs: 400, sidecarArgs }, async (cluster) => {
    const [a] = cluster.nodes as [Cluster["nodes"][number]];
    const toA = cluster.client({}, [a]);
    const key = "killed-owner";
    const first = await toA.sendTurn(key, { text: "before", tokens: 1 });
    assert.equal(first.owner, "node-a");

    await a.kill9();
    const killed = Date.now();
    const client = cluster.client(); // a first: refused, then b forwards to the dead owner
    const answer = await client.sendTurn(key, { text: "after", tokens: 1 });
    const took = Date.now() - killed;
    const body = await answer.json<DemoAnswer>();
    assert.equal(answer.status, 200);
    assert.notEqual(answer.owner, "node-a");
    assert.equal(answer.epoch, 2, "taken over with epoch + 1");
    assert.equal(body.history_len, 2, "history intact across the takeover");
    assert.ok(answer.directives.length > 0, "the takeover was waited for by directive");
    for (const code of answer.directives) {
      assert.ok(["takeover_pending", "owner_unreachable"].includes(code), code);
    }
    assert.ok(took < 2000 + 4000, `served ${took} ms after the kill (TTL 2 s)`);
  });
});

test("a drained pod's directives are obeyed until their budget runs out: RetryBudgetExhausted", async () => {
  await withCluster({ nodes: 1, drainTimeoutMs: 1000 }, async (cluster) => {
    const [a] = cluster.nodes as [Cluster["nodes"][number]];
    const report = await drain(a, cluster.secret);
    assert.equal(report.in_flight_stood_down, 0);
    // The only node refuses with `draining` (delay 25 ms, budget = its drain timeout).
    const client = cluster.client();
    const started = Date.now();
    await assert.rejects(client.sendTurn("budget", { text: "x" }), (error: unknown) => {
      assert.ok(error instanceof RetryBudgetExhausted, String(error));
      assert.equal(error.code, "retry_budget_exhausted");
      assert.equal(error.directive?.error, "draining");
      assert.equal(error.directive.budgetMs, 1000);
      assert.ok(error.directives.length > 1, "re-sent as directed before giving up");
      assert.ok(error.directives.every((d) => d === "draining"));
      return true;
    });
    const took = Date.now() - started;
    assert.ok(took >= 900 && took < 3000, `gave up after ${took} ms (budget 1000 ms)`);
  });
});

test("the README's minimal agent serves turns behind two sidecars, its state following the session", async () => {
  await withCluster({ nodes: 2, agent: { kind: "program", script: MINIMAL_AGENT_JS } }, async (cluster) => {
    const [a, b] = cluster.nodes as [Cluster["nodes"][number], Cluster["nodes"][number]];
    const key = "minimal";
    assert.deepEqual(await (await cluster.client({}, [a]).sendTurn(key, { text: "one" })).json(), { history_len: 1, epoch: 1 });
    await drain(a, cluster.secret); // hand the session to node-b
    const answer = await cluster.client({}, [b]).sendTurn(key, { text: "two" });
    assert.equal(answer.owner, "node-b");
    assert.deepEqual(await answer.json(), { history_len: 2, epoch: 2 });
  });
});
