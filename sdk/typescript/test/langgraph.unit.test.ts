/**
 * `LeaseholdSaver` on an in-memory stand-in for the sidecar's checkpoint API (one blob,
 * fenced by epoch): LangGraph runs on it exactly as on its own MemorySaver; list
 * filters; trimming; a stale epoch refused.
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import { Annotation, END, MemorySaver, START, StateGraph } from "@langchain/langgraph";
import type { BaseCheckpointSaver } from "@langchain/langgraph-checkpoint";

import { Fenced, Session, SidecarApi } from "../src/agent.js";
import { LeaseholdSaver } from "../src/langgraph.js";

/** The agent API's checkpoint routes over one stored blob; writes below `epoch` are fenced. */
function fakeSidecar(): { api: SidecarApi; store: { blob: string | undefined; epoch: number; writes: number } } {
  const store = { blob: undefined as string | undefined, epoch: 1, writes: 0 };
  const fetchImpl = async (_input: string | URL | Request, init?: RequestInit): Promise<Response> => {
    await Promise.resolve();
    const method = init?.method ?? "GET";
    if (method === "GET") {
      return store.blob === undefined ? new Response('{"error":"no_checkpoint"}', { status: 404 }) : new Response(store.blob, { headers: { "leasehold-checkpoint-epoch": String(store.epoch) } });
    }
    const epoch = Number((init?.headers as Record<string, string>)["leasehold-epoch"]);
    if (epoch < store.epoch) return new Response('{"error":"fenced"}', { status: 409 });
    store.epoch = epoch;
    store.blob = init?.body as string; // the saver writes the blob as a JSON string
    store.writes += 1;
    return new Response(null, { status: 204 });
  };
  return { api: new SidecarApi("http://sidecar.invalid", fetchImpl), store };
}

const State = Annotation.Root({
  items: Annotation<string[]>({ reducer: (a, b) => a.concat(b), default: () => [] }),
  input: Annotation<string>(),
});

function graph(checkpointer: BaseCheckpointSaver) {
  return new StateGraph(State)
    .addNode("a", (s: typeof State.State) => ({ items: [`a:${s.input}`] }))
    .addNode("b", (s: typeof State.State) => ({ items: [`b:${s.input}`] }))
    .addNode("c", (s: typeof State.State) => ({ items: [`c:${s.input}`] }))
    .addEdge(START, "a")
    .addEdge(START, "b") // a and b run in one superstep: two tasks' writes
    .addEdge("a", "c")
    .addEdge("b", "c")
    .addEdge("c", END)
    .compile({ checkpointer });
}

test("a graph runs on LeaseholdSaver as on MemorySaver: same states, same history", async () => {
  const { api, store } = fakeSidecar();
  const memory = new MemorySaver();
  const key = "unit-thread";
  const config = { configurable: { thread_id: key } };
  for (const [i, input] of ["x", "y", "z"].entries()) {
    // A new turn (and saver) each time, as an agent does.
    const session = new Session(api, { key, epoch: 1, turnId: `t${i}` });
    const ours = await graph(LeaseholdSaver.forSession(session, { maxCheckpoints: 100 })).invoke({ input }, config);
    const theirs = await graph(memory).invoke({ input }, config);
    assert.deepEqual(ours, theirs);
  }
  assert.ok(store.writes > 0);
  const session = new Session(api, { key, epoch: 1, turnId: "read" });
  const saver = LeaseholdSaver.forSession(session, { maxCheckpoints: 100 });
  const ours: unknown[] = [];
  for await (const s of graph(saver).getStateHistory(config)) ours.push([s.values, s.next, s.metadata?.step]);
  const theirs: unknown[] = [];
  for await (const s of graph(memory).getStateHistory(config)) theirs.push([s.values, s.next, s.metadata?.step]);
  assert.equal(ours.length, theirs.length);
  assert.deepEqual(ours, theirs);

  // list(): limit, before, filter.
  const all = [];
  for await (const t of saver.list(config)) all.push(t);
  const limited = [];
  const id = (t: { config: { configurable?: Record<string, unknown> } }): unknown => t.config.configurable?.checkpoint_id;
  for await (const t of saver.list(config, { limit: 2 })) limited.push(id(t));
  assert.deepEqual(limited, all.slice(0, 2).map(id));
  const before = [];
  for await (const t of saver.list(config, { before: all[2]?.config })) before.push(id(t));
  assert.deepEqual(before, all.slice(3).map(id));
  const inputs = [];
  for await (const t of saver.list(config, { filter: { source: "input" } })) inputs.push(t);
  assert.equal(inputs.length, 3, "one input checkpoint per invoke");
  const other = [];
  for await (const t of saver.list({ configurable: { thread_id: "another" } })) other.push(t);
  assert.equal(other.length, 0);
  await assert.rejects(saver.getTuple({ configurable: { thread_id: "another" } }), /thread_id is the session key/);
});

test("the blob keeps the latest maxCheckpoints; a stale epoch's write is Fenced and changes nothing", async () => {
  const { api, store } = fakeSidecar();
  const key = "unit-trim";
  const config = { configurable: { thread_id: key } };
  for (let i = 0; i < 4; i++) {
    await graph(LeaseholdSaver.forSession(new Session(api, { key, epoch: 1, turnId: `t${i}` }), { maxCheckpoints: 5 })).invoke({ input: `i${i}` }, config);
  }
  const blob = JSON.parse(store.blob ?? "{}") as { checkpoints: { id: string }[]; writes: { checkpoint_id: string }[] };
  assert.equal(blob.checkpoints.length, 5);
  const kept = new Set(blob.checkpoints.map((c) => c.id));
  assert.ok(blob.writes.every((w) => kept.has(w.checkpoint_id)), "writes of dropped checkpoints are dropped");
  const latest = await LeaseholdSaver.forSession(new Session(api, { key, epoch: 1, turnId: "r" })).getTuple(config);
  assert.deepEqual((latest?.checkpoint.channel_values as { items?: string[] }).items?.slice(-3), ["a:i3", "b:i3", "c:i3"]);

  // A new owner at epoch 2 writes; the old epoch's saver is refused from then on.
  const stale = LeaseholdSaver.forSession(new Session(api, { key, epoch: 1, turnId: "zombie" }));
  await graph(LeaseholdSaver.forSession(new Session(api, { key, epoch: 2, turnId: "new" }))).invoke({ input: "new" }, config);
  const stored = store.blob;
  await assert.rejects(graph(stale).invoke({ input: "zombie" }, config), Fenced);
  await assert.rejects(stale.deleteThread(key), Fenced);
  assert.equal(store.blob, stored, "nothing of the zombie landed");

  // deleteThread by the owner empties the thread.
  const owner = LeaseholdSaver.forSession(new Session(api, { key, epoch: 2, turnId: "del" }));
  await owner.deleteThread(key);
  assert.equal(await owner.getTuple(config), undefined);
  await assert.rejects(owner.deleteThread("another"), /cannot delete thread/);
});

test("a checkpoint that is not a LeaseholdSaver blob is never overwritten", async () => {
  const { api, store } = fakeSidecar();
  store.blob = JSON.stringify({ history: ["from the demo agent"] });
  const saver = LeaseholdSaver.forSession(new Session(api, { key: "unit-foreign", epoch: 1, turnId: "t" }));
  await assert.rejects(graph(saver).invoke({ input: "x" }, { configurable: { thread_id: "unit-foreign" } }), /not a leasehold\.langgraph\/1 blob/);
  assert.equal(store.blob, JSON.stringify({ history: ["from the demo agent"] }));
});
