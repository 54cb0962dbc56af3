/**
 * The agent-side SDK against real sidecars, with the agents served from this process
 * so the test sees what the SDK surfaced: a fenced checkpoint after the owner's sidecar
 * was frozen past its TTL, stand-downs, turn ids, publish ids, release.
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import { createAgentHandler, Fenced, SidecarApi, type AgentHandler, type Session } from "../src/agent.js";
import { Cluster, drain, gate, lapsed, waitFor, withCluster } from "./support/cluster.js";

type Nodes = Cluster["nodes"];

interface Input {
  text: string;
  hold?: boolean;
}

interface Seen {
  node: string;
  key: string;
  epoch: number;
  turnId: string;
  published: string[];
  thawedEpoch: number | undefined;
  resumed: boolean;
}

test("a checkpoint of an owner whose sidecar froze past its TTL is refused: Fenced, and nothing of it lands", async () => {
  const held = gate();
  const release = gate();
  const zombieOutcome = gate<unknown>();
  const seen: Seen[] = [];
  const standDowns: string[] = [];
  const make = ({ name, agentApiUrl }: { name: string; agentApiUrl: string }): AgentHandler =>
    createAgentHandler({
      sidecarUrl: agentApiUrl,
      onStandDown: (key) => {
        standDowns.push(`${name}:${key}`);
      },
      onError: () => undefined,
      onTurn: async (session: Session, request) => {
        const input = request.json<Input>();
        const thawed = await session.thaw();
        const history = thawed?.json<{ history: string[] }>().history ?? [];
        const published = [await session.publish("turn_started", { text: input.text, node: name })];
        seen.push({ node: name, key: session.key, epoch: session.epoch, turnId: session.turnId, published, thawedEpoch: thawed?.epoch, resumed: session.resumed });
        // Only the first attempt holds: the next owner resumes the same turn (exactly once).
        if (input.hold === true && !session.resumed) {
          held.open();
          await release.promise;
          try {
            await session.checkpoint({ history: [...history, input.text] });
            zombieOutcome.open("landed");
          } catch (error) {
            zombieOutcome.open(error);
            throw error; // the SDK answers 409 fenced
          }
        } else {
          await session.checkpoint({ history: [...history, input.text] });
        }
        return { history_len: history.length + 1, epoch: session.epoch, node: name };
      },
    });

  await withCluster({ leaseTtlMs: 2000, heartbeatMs: 400, agent: { kind: "in-process", make } }, async (cluster) => {
    const [a, b, c] = cluster.nodes as [Nodes[number], Nodes[number], Nodes[number]];
    const key = "frozen-owner";
    const first = await cluster.client({}, [a]).sendTurn(key, { text: "first" });
    assert.equal(first.owner, "node-a");
    const firstSeen = seen[0];
    assert.ok(firstSeen);
    assert.equal(firstSeen.turnId, first.idempotencyKey, "the agent's turn id is the client's key");
    assert.match(firstSeen.published[0] ?? "", /^1-\d+$/, "publish returns <epoch>-<seq>");

    // A turn starts on node-a and holds before its checkpoint; node-a's sidecar freezes.
    const zombie = fetch(`${a.publicUrl}/v1/sessions/${key}/turns`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ text: "zombie", hold: true }),
    }).then(async (r) => ({ status: r.status, body: await r.text() }));
    await held.promise;
    a.sidecar.pause();
    try {
      const others = cluster.client({}, [b, c]);
      // Lapsed: claimable, or already claimed by another pod's sweep (it resumes the
      // session's unfinished turn as soon as no live owner holds it).
      await waitFor("node-a's lease to lapse", async () => lapsed(await others.session(key), "node-a"), 10_000, 100);
      const after = await others.sendTurn(key, { text: "after" });
      assert.equal(after.epoch, 2, "taken over");
      assert.notEqual(after.owner, "node-a");
      // The new owner first resumed the interrupted turn (once), then ran this one.
      assert.equal((await after.json<{ history_len: number }>()).history_len, 3);
      const resumed = seen.filter((s) => s.resumed);
      assert.equal(resumed.length, 1, "the interrupted turn was resumed once");
      const [resume] = resumed;
      assert.ok(resume);
      assert.equal(resume.thawedEpoch, 1, "the new owner thawed node-a's checkpoint of epoch 1");
      assert.equal(resume.epoch, 2);
      // The zombie goes on to write its checkpoint into the frozen sidecar.
      release.open();
    } finally {
      a.sidecar.resume();
    }

    const answer = await zombie;
    const zombieError = await zombieOutcome.promise;
    assert.ok(zombieError instanceof Fenced, `the zombie's checkpoint threw Fenced, got ${String(zombieError)}`);
    console.log(`zombie checkpoint refused via ${zombieError.via}`);
    // node-a halted the turn: `503 fenced` if the zombie's checkpoint was refused before
    // the turn was halted, `502 owner_failed` if it was already on its way (it might have
    // landed, as far as node-a can know); never a success.
    const error = (JSON.parse(answer.body) as { error: string }).error;
    assert.ok(
      (answer.status === 503 && error === "fenced") || (answer.status === 502 && error === "owner_failed"),
      `${answer.status} ${answer.body}`,
    );
    await waitFor("node-a's stand-down of the session", () => standDowns.includes(`node-a:${key}`));

    // What is stored is the new owner's history ("zombie" once: its resume at epoch 2);
    // node-a's write never landed.
    const stored = await new SidecarApi(b.agentApiUrl).getCheckpoint(key);
    assert.deepEqual(stored?.json(), { history: ["first", "zombie", "after"] });
    assert.equal(stored.epoch, 2);

    // A write at the old epoch is refused by the fence on any node (the sidecar's 409).
    for (const node of [a, b]) {
      await assert.rejects(new SidecarApi(node.agentApiUrl).putCheckpoint(key, 1, { history: ["stale"] }), (error: unknown) => {
        assert.ok(error instanceof Fenced);
        assert.equal(error.via, "sidecar");
        return true;
      });
    }
    // And the handler answers a Fenced thrown out of a turn with 409 {"error":"fenced"}
    // (a dispatch at the stale epoch, sent to node-b's agent the way its sidecar would).
    const direct = await fetch(`${b.agentUrl}/sessions/${key}/turns`, {
      method: "POST",
      headers: { "leasehold-epoch": "1", "leasehold-turn-id": crypto.randomUUID(), "content-type": "application/json" },
      body: JSON.stringify({ text: "stale dispatch" }),
    });
    assert.equal(direct.status, 409);
    assert.deepEqual(await direct.json(), { error: "fenced" });
    const final = await new SidecarApi(b.agentApiUrl).getCheckpoint(key);
    assert.deepEqual(final?.json(), { history: ["first", "zombie", "after"] });
  });
});

test("stand-down aborts a running turn's signal with Fenced; release makes the session claimable at once", async () => {
  const held = gate();
  let reason: unknown;
  let afterStandDown: unknown;
  const kept = new Map<string, Session>();
  const make = ({ name, agentApiUrl }: { name: string; agentApiUrl: string }): AgentHandler =>
    createAgentHandler({
      sidecarUrl: agentApiUrl,
      onTurn: async (session, request) => {
        const input = request.json<Input>();
        await session.checkpoint({ text: input.text });
        kept.set(`${name}:${session.key}`, session);
        if (input.hold === true) {
          held.open();
          await new Promise((resolve) => {
            session.signal.addEventListener("abort", resolve, { once: true });
          });
          reason = session.signal.reason;
          afterStandDown = await session.publish("late", {}).catch((e: unknown) => e);
          session.throwIfHalted();
        }
        return { node: name, epoch: session.epoch };
      },
    });
  await withCluster({ drainTimeoutMs: 500, agent: { kind: "in-process", make } }, async (cluster) => {
    const [a, b] = cluster.nodes as [Nodes[number], Nodes[number]];
    const key = "stand-down";
    const toA = cluster.client({}, [a]);
    assert.equal((await toA.sendTurn(key, { text: "one" })).owner, "node-a");
    const turn = fetch(`${a.publicUrl}/v1/sessions/${key}/turns`, {
      method: "POST",
      body: JSON.stringify({ text: "held", hold: true }),
    }).then((r) => r.status);
    await held.promise;
    const report = await drain(a, cluster.secret);
    assert.equal(report.in_flight_stood_down, 1);
    assert.ok(reason instanceof Fenced, String(reason));
    assert.equal(reason.via, "stand-down");
    assert.ok(afterStandDown instanceof Fenced, "writes after a stand-down throw Fenced without a round trip");
    assert.notEqual(await turn, 200);

    // release() once the session idled out (after its turn): claimable before any TTL.
    const key2 = "released";
    const toB = cluster.client({}, [b]);
    assert.deepEqual(await (await toB.sendTurn(key2, { text: "x" })).json(), { node: "node-b", epoch: 1 });
    assert.equal((await toB.session(key2)).claimable, false);
    const idle = kept.get(`node-b:${key2}`);
    assert.ok(idle);
    await idle.release();
    const info = await toB.session(key2);
    assert.equal(info.claimable, true, "released: claimable at once");
    assert.equal(info.owner, null);
    // The next turn anywhere claims it again, with the next epoch.
    const next = await cluster.client({}, [cluster.nodes[2] as Nodes[number]]).sendTurn(key2, { text: "y" });
    assert.equal(next.owner, "node-c");
    assert.equal(next.epoch, 2);
  });
});
