/**
 * docs/http-api.md, turn semantics features (and the header allow-list of §2) through the SDK. The SDK
 * implements each; a server that lacks one is detected by a checked condition and the
 * test is SKIPPED with that reason, never passed silently.
 */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { createAgentHandler, Interrupted, SidecarRefused, type AgentHandler, type JournalEvent } from "../src/agent.js";
import { Busy, IdempotencyKeyReused, type TurnResult } from "../src/index.js";
import { Cluster, binDir, gate, waitFor } from "./support/cluster.js";

type Nodes = Cluster["nodes"];

interface Body {
  text: string;
  hold?: boolean;
  journal?: boolean;
}

interface Run {
  node: string;
  key: string;
  turnId: string;
  resumeOf: string | undefined;
  text: string;
  clientHeaders: Record<string, string>;
  journal?: JournalEvent[] | SidecarRefused;
  aborted?: unknown;
}

const runs: Run[] = [];
/** Turns whose text is in here wait for the gate (a test-controlled long turn). */
let hold = gate();
let holding = gate();

function make({ name, agentApiUrl }: { name: string; agentApiUrl: string }): AgentHandler {
  return createAgentHandler({
    sidecarUrl: agentApiUrl,
    onError: () => undefined,
    onTurn: async (session, request) => {
      const body = request.json<Body>();
      const clientHeaders: Record<string, string> = {};
      request.clientHeaders.forEach((v, k) => {
        clientHeaders[k] = v;
      });
      const run: Run = { node: name, key: session.key, turnId: session.turnId, resumeOf: session.resumeOf, text: body.text, clientHeaders };
      runs.push(run);
      await session.publish("turn_started", { text: body.text });
      if (body.journal === true || session.resumeOf !== undefined) {
        run.journal = await session.journalEvents().catch((e: unknown) => {
          if (e instanceof SidecarRefused) return e;
          throw e;
        });
      }
      // Only the first attempt holds: a resumed one (the same turn) runs through.
      if (body.hold === true && session.resumeOf === undefined) {
        holding.open();
        const aborted = new Promise((resolve) => {
          session.signal.addEventListener("abort", resolve, { once: true });
        });
        await Promise.race([hold.promise, aborted]);
        run.aborted = session.signal.aborted ? session.signal.reason : undefined;
        session.throwIfHalted();
      }
      await session.publish("turn_finished", { text: body.text });
      return { text: body.text, node: name, epoch: session.epoch, turnId: session.turnId };
    },
  });
}

let cluster: Cluster;
before(async () => {
  cluster = await Cluster.start({ leaseTtlMs: 2000, heartbeatMs: 400, agent: { kind: "in-process", make } });
});
after(async () => {
  await cluster.stop();
});

function reset(): void {
  hold = gate();
  holding = gate();
}

/** Whether the server answers GET turns/{id} for a turn it just ran (else: why not). */
let turnsSupported: string | true | undefined;
async function probeGetTurn(): Promise<string | true> {
  if (turnsSupported !== undefined) return turnsSupported;
  const client = cluster.client();
  const answer = await client.sendTurn("probe-get-turn", { text: "probe" });
  const info = await client.turn("probe-get-turn", answer.idempotencyKey);
  turnsSupported = info === undefined ? `the server answered 404 to GET /v1/sessions/{key}/turns/${answer.idempotencyKey} for a turn it had just run` : true;
  return turnsSupported;
}

test("every turn's Leasehold-Turn-Id is the client's Idempotency-Key (stable across re-sends)", async () => {
  const answer = await cluster.client().sendTurn("turn-id", { text: "x" });
  const run = runs.find((r) => r.key === "turn-id");
  assert.equal(run?.turnId, answer.idempotencyKey);
});

test("GET /v1/sessions/{key}/turns/{id} reports a finished turn (docs/http-api.md, turn semantics)", async () => {
  const supported = await probeGetTurn();
  if (supported !== true) {
    assert.fail(supported);
  }
  const client = cluster.client();
  const answer = await client.sendTurn("get-turn", { text: "x" });
  const info = await client.turn("get-turn", answer.idempotencyKey);
  assert.equal(info?.turnId, answer.idempotencyKey);
  assert.equal(info.state, "finished");
  assert.equal(info.epoch, answer.epoch);
  assert.equal(await client.turn("get-turn", crypto.randomUUID()), undefined, "an unknown turn is 404");
});

test("a repeated Idempotency-Key is answered from the record, never run twice; another body is 422 (docs/http-api.md, turn semantics)", async () => {
  const client = cluster.client();
  const key = "idempotent";
  const idempotencyKey = crypto.randomUUID();
  const first = await client.sendTurn(key, { text: "once" }, { idempotencyKey });
  const firstBody = await first.text();
  const second = await client.sendTurn(key, { text: "once" }, { idempotencyKey });
  const secondBody = await second.text();
  const ran = runs.filter((r) => r.key === key).length;
  if (!second.replayed) {
    assert.fail(`no Leasehold-Replayed on a repeated Idempotency-Key (the agent ran the turn ${ran} times): the server did not record the idempotency key`);
  }
  assert.equal(ran, 1, "ran once");
  assert.equal(secondBody, firstBody, "the recorded answer");
  assert.equal(first.replayed, false);
  await assert.rejects(client.sendTurn(key, { text: "another body" }, { idempotencyKey }), IdempotencyKeyReused);
});

/** Start a held turn on the session's owner; its promise and its run. */
async function heldTurn(key: string): Promise<{ answer: Promise<TurnResult>; run: Run }> {
  reset();
  const client = cluster.client({}, [cluster.nodes[0] as Nodes[number]]);
  const answer = client.sendTurn(key, { text: "long", hold: true });
  answer.catch(() => undefined);
  await holding.promise;
  const run = runs.filter((r) => r.key === key).at(-1) as Run;
  return { answer, run };
}

/** `promise`'s outcome if it settles within `ms`, else "pending". */
async function within<T>(promise: Promise<T>, ms: number): Promise<{ value: T } | { error: unknown } | "pending"> {
  let timer: NodeJS.Timeout | undefined;
  const deadline = new Promise<"pending">((resolve) => {
    timer = setTimeout(() => {
      resolve("pending");
    }, ms);
  });
  try {
    return await Promise.race([promise.then((value) => ({ value }), (error: unknown) => ({ error })), deadline]);
  } finally {
    clearTimeout(timer);
  }
}

test("Leasehold-Multitask: reject answers 409 busy naming the running turn (docs/http-api.md, turn semantics)", async () => {
  const key = "multitask-reject";
  const { answer, run } = await heldTurn(key);
  const second = cluster.client().sendTurn(key, { text: "second" }, { multitask: "reject" });
  const outcome = await within(second, 3000);
  hold.open(undefined);
  await answer;
  if (outcome === "pending" || "value" in outcome) {
    await second.catch(() => undefined);
    assert.fail("a turn sent with Leasehold-Multitask: reject while another ran was not refused (it waited): the server ignored the header");
  }
  assert.ok(outcome.error instanceof Busy, String(outcome.error));
  assert.equal(outcome.error.turnId, run.turnId);
});

test("Leasehold-Multitask: interrupt cancels the running turn through the agent (docs/http-api.md, turn semantics)", async () => {
  const key = "multitask-interrupt";
  const { answer, run } = await heldTurn(key);
  const second = cluster.client().sendTurn(key, { text: "second" }, { multitask: "interrupt" });
  const cancelled = await waitFor("the running turn's cancel", () => run.aborted !== undefined, 3000).then(
    () => true,
    () => false,
  );
  if (!cancelled) {
    hold.open(undefined);
    await answer;
    await second;
    assert.fail("a turn sent with Leasehold-Multitask: interrupt did not cancel the running one: the server ignored the header");
  }
  assert.ok(run.aborted instanceof Interrupted, "the agent's signal was aborted with Interrupted");
  await assert.rejects(answer, Interrupted);
  assert.equal((await second).status, 200);
});

test("the agent reads a turn's journal (GET /v1/sessions/{key}/turns/{id}/events, docs/http-api.md, the agent API)", async () => {
  const key = "journal";
  await cluster.client().sendTurn(key, { text: "j", journal: true });
  const run = runs.find((r) => r.key === key) as Run;
  if (run.journal instanceof SidecarRefused) {
    assert.equal(run.journal.status, 404, String(run.journal));
    assert.fail("the sidecar's agent API answers 404 to GET /v1/sessions/{key}/turns/{id}/events: no journal");
  }
  assert.ok(Array.isArray(run.journal), "a list");
  assert.deepEqual(run.journal, [], "a first attempt has no earlier events");
});

test("a turn re-dispatched after its owner died mid-turn carries Leasehold-Resume and finds its journal (docs/http-api.md, turn semantics)", async () => {
  const supported = await probeGetTurn();
  if (supported !== true) {
    assert.fail(`resume needs the turn journal: ${supported}`);
  }
  const key = "resume";
  const a = cluster.nodes[0] as Nodes[number];
  const { run } = await heldTurn(key);
  // A 202 is durable once journaled (group commits); the sidecar fans out only journaled
  // events, so one a watcher received survives the kill.
  for await (const event of cluster.client({}, [cluster.nodes[1] as Nodes[number]]).stream(key)) {
    if (event.type === "turn_started" && (event.data as { text?: string }).text === "long") break;
  }
  await a.kill9(); // no client waits for the turn any more
  const client = cluster.client({}, cluster.nodes.slice(1));
  const info = await waitFor("the turn finished elsewhere", async () => {
    const t = await client.turn(key, run.turnId);
    return t?.state === "finished" ? t : undefined;
  });
  assert.equal(info.epoch, 2);
  const resumed = runs.find((r) => r.key === key && r.resumeOf === run.turnId);
  assert.ok(resumed, "re-dispatched with Leasehold-Resume");
  assert.notEqual(resumed.node, "node-a");
  assert.ok(Array.isArray(resumed.journal), "the resumed attempt read the journal");
  assert.deepEqual(
    resumed.journal.map((e) => [e.type, e.data]),
    [["turn_started", { text: "long" }]],
    "the interrupted attempt's events",
  );
});

test("allow-listed client headers reach the agent unchanged (--forward-headers, docs/http-api.md, configuration)", async () => {
  const help = spawnSync(join(binDir(), "leasehold-sidecar"), ["--help"], { encoding: "utf8" }).stdout;
  if (!help.includes("--forward-headers")) {
    assert.fail("leasehold-sidecar has no --forward-headers: client headers are not forwarded to the agent");
  }
  const key = "headers";
  await cluster.client().sendTurn(key, { text: "h" }, { headers: { "x-request-id": "req-1", traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "x-private": "no" } });
  const run = runs.find((r) => r.key === key) as Run;
  assert.equal(run.clientHeaders["x-request-id"], "req-1");
  assert.equal(run.clientHeaders.traceparent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
  assert.equal(run.clientHeaders["x-private"], undefined);
});
