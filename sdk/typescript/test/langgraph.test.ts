/**
 * `LeaseholdSaver` against real sidecars: the example LangGraph agent keeps its graph
 * state across pods and a kill -9; a zombie owner's graph write is refused.
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import { Annotation, END, START, StateGraph } from "@langchain/langgraph";

import { createAgentHandler, Fenced, Session, SidecarApi, type AgentHandler } from "../src/agent.js";
import type { LeaseholdEvent } from "../src/index.js";
import { BLOB_FORMAT, LeaseholdSaver } from "../src/langgraph.js";
import { Cluster, LANGGRAPH_AGENT_JS, gate, lapsed, waitFor, withCluster } from "./support/cluster.js";

type Nodes = Cluster["nodes"];

interface ExampleAnswer {
  reply: string;
  turns: number;
  messages: number;
  epoch: number;
  node: string;
}

interface StoredBlob {
  format: string;
  thread_id: string;
  checkpoints: { ns: string; id: string }[];
  writes: unknown[];
}

test("the example LangGraph agent continues its graph state across pods and a kill -9 of the owner", async () => {
  await withCluster({ leaseTtlMs: 2000, heartbeatMs: 400, agent: { kind: "program", script: LANGGRAPH_AGENT_JS } }, async (cluster) => {
    const [a] = cluster.nodes as [Nodes[number]];
    const key = "graph-thread";
    const client = cluster.client();
    const controller = new AbortController();
    const events: LeaseholdEvent[] = [];
    const observing = (async () => {
      for await (const e of cluster.client({}, [cluster.nodes[2] as Nodes[number]]).stream(key, { signal: controller.signal })) events.push(e);
    })().catch(() => undefined);
    await waitFor("observer", async () => (await (cluster.nodes[2] as Nodes[number]).metric("leasehold_observers")) >= 1);

    const first = await cluster.client({}, [a]).sendTurn(key, { text: "hello 1" });
    assert.equal(first.owner, "node-a");
    const TURNS = 8;
    for (let i = 2; i <= TURNS; i++) {
      const answer = await client.sendTurn(key, { text: `hello ${i}` });
      const body = await answer.json<ExampleAnswer>();
      assert.equal(body.turns, i, "the graph's turn counter continues");
      assert.equal(body.messages, 2 * i);
      assert.equal(body.reply, `you said "hello ${i}" (turn ${i})`);
      assert.equal(body.node, "node-a");
    }
    // Every node's update reached the observer on node-c.
    await waitFor("graph updates", () => events.filter((e) => e.type === "graph_update").length >= 2 * TURNS);
    const updates = events.filter((e) => e.type === "graph_update").map((e) => Object.keys(e.data as object)[0]);
    assert.deepEqual(updates.slice(0, 2), ["receive", "respond"]);

    // One blob, the thread's latest 20 checkpoints (8 turns made 32).
    const stored = (await new SidecarApi(a.agentApiUrl).getCheckpoint(key))?.json<StoredBlob>();
    assert.equal(stored?.format, BLOB_FORMAT);
    assert.equal(stored.thread_id, key);
    assert.equal(stored.checkpoints.length, 20);

    await a.kill9();
    const after = await client.sendTurn(key, { text: "after the crash" });
    const body = await after.json<ExampleAnswer>();
    assert.equal(after.epoch, 2);
    assert.notEqual(body.node, "node-a");
    assert.equal(body.turns, TURNS + 1, "the new owner resumed the graph from the fenced checkpoint");
    assert.equal(body.reply, `you said "after the crash" (turn ${TURNS + 1})`);
    controller.abort();
    await observing;
  });
});

const GraphState = Annotation.Root({
  log: Annotation<string[]>({ reducer: (a, b) => a.concat(b), default: () => [] }),
  input: Annotation<string>(),
  hold: Annotation<boolean>(),
});

test("the checkpointer refuses a zombie's write: Fenced out of the graph, the new owner's state untouched", async () => {
  const held = gate();
  const release = gate();
  const zombieOutcome = gate<unknown>();
  const makeGraph = (session: Session) =>
    new StateGraph(GraphState)
      .addNode("think", async (state: typeof GraphState.State) => {
        if (state.hold) {
          held.open();
          await release.promise;
        }
        return { log: [`thought about ${state.input} at epoch ${session.epoch}`] };
      })
      .addNode("answer", (state: typeof GraphState.State) => ({ log: [`answered ${state.input}`] }))
      .addEdge(START, "think")
      .addEdge("think", "answer")
      .addEdge("answer", END)
      .compile({ checkpointer: LeaseholdSaver.forSession(session) });
  const make = ({ name, agentApiUrl }: { name: string; agentApiUrl: string }): AgentHandler =>
    createAgentHandler({
      sidecarUrl: agentApiUrl,
      onError: () => undefined,
      onTurn: async (session, request) => {
        const { text, hold } = request.json<{ text: string; hold?: boolean }>();
        const graph = makeGraph(session);
        const config = { configurable: { thread_id: session.key } };
        // The zombie is node-a's attempt; the next owner resumes the same turn and runs through.
        const zombieAttempt = hold === true && !session.resumed;
        try {
          const state = await graph.invoke({ input: text, hold: zombieAttempt }, config);
          if (zombieAttempt) zombieOutcome.open("completed");
          return { log: state.log, node: name, epoch: session.epoch };
        } catch (error) {
          if (zombieAttempt) zombieOutcome.open(error);
          throw error;
        }
      },
    });

  await withCluster({ leaseTtlMs: 2000, heartbeatMs: 400, agent: { kind: "in-process", make } }, async (cluster) => {
    const [a, b, c] = cluster.nodes as [Nodes[number], Nodes[number], Nodes[number]];
    const key = "graph-zombie";
    const first = await cluster.client({}, [a]).sendTurn(key, { text: "first" });
    assert.equal(first.owner, "node-a");
    assert.deepEqual((await first.json<{ log: string[] }>()).log, ["thought about first at epoch 1", "answered first"]);

    const zombie = fetch(`${a.publicUrl}/v1/sessions/${key}/turns`, { method: "POST", body: JSON.stringify({ text: "zombie", hold: true }) }).then((r) => r.status);
    await held.promise;
    a.sidecar.pause();
    let blobAfterTakeover: string | undefined;
    try {
      const others = cluster.client({}, [b, c]);
      // Lapsed: claimable, or already claimed by another pod's sweep (it resumes the
      // session's unfinished turn as soon as no live owner holds it).
      await waitFor("node-a's lease to lapse", async () => lapsed(await others.session(key), "node-a"), 10_000, 100);
      const after = await others.sendTurn(key, { text: "after" });
      assert.equal(after.epoch, 2);
      const log = (await after.json<{ log: string[] }>()).log;
      assert.deepEqual(log.slice(0, 2), ["thought about first at epoch 1", "answered first"], "the new owner continued the thread");
      assert.deepEqual(log.slice(-2), ["thought about after at epoch 2", "answered after"]);
      // The interrupted turn was resumed once by the new owner, before "after"; nothing
      // of node-a's attempt is in the thread.
      assert.deepEqual(log.slice(2, 4), ["thought about zombie at epoch 2", "answered zombie"]);
      assert.equal(log.length, 6, log.join(" | "));
      blobAfterTakeover = (await new SidecarApi(b.agentApiUrl).getCheckpoint(key))?.text();
      release.open(); // the zombie's graph goes on and writes its next checkpoint into the frozen sidecar
    } finally {
      a.sidecar.resume();
    }

    const outcome = await zombieOutcome.promise;
    assert.ok(outcome instanceof Fenced, `the zombie's graph failed with Fenced, got ${String(outcome)}`);
    assert.notEqual(await zombie, 200, "the zombie's turn was not acknowledged");
    const blob = await new SidecarApi(b.agentApiUrl).getCheckpoint(key);
    assert.equal(blob?.epoch, 2);
    assert.equal(blob.text(), blobAfterTakeover, "the stored graph state is byte for byte the new owner's");

    // A saver for the stale epoch, used directly: every write refused, nothing stored.
    const stale = LeaseholdSaver.forSession(new Session(new SidecarApi(a.agentApiUrl), { key, epoch: 1, turnId: crypto.randomUUID() }));
    const latest = await stale.getTuple({ configurable: { thread_id: key } });
    assert.ok(latest, "the stale saver still reads the thread");
    await assert.rejects(stale.deleteThread(key), Fenced);
    assert.equal((await new SidecarApi(b.agentApiUrl).getCheckpoint(key))?.text(), blobAfterTakeover);
  });
});
