/**
 * Exactly-once turns (docs/http-api.md, turn semantics) through the SDK, against local
 * stand-ins for the sidecar on 127.0.0.1.
 *
 * The sidecar's side of these (idempotency replay, `409 busy`, `503 queue_full`, `GET`
 * and `DELETE` of a turn, `Leasehold-Resume`, the cancel call) is being built in the
 * sidecar right now; the real-sidecar versions come with it (contract.test.ts probes
 * for them). Here the client talks to a small HTTP server that speaks exactly that
 * interface (a key with the same body runs once and is replayed with `Leasehold-Replayed:
 * true`; with another body it is `422 idempotency_key_reused`), and the agent handler is
 * served on loopback with a fake agent API (the `fetch` option) that serves the journal
 * of a turn's earlier attempts.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { createServer, type IncomingHttpHeaders, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { after, test } from "node:test";
import { fileURLToPath } from "node:url";

import { onCancel as exampleOnCancel, onTurn as exampleOnTurn } from "../examples/resumable-agent.js";
import { createAgentHandler, Interrupted, type Session } from "../src/agent.js";
import { Busy, Client, IdempotencyKeyReused } from "../src/index.js";

const servers: Server[] = [];
after(() => {
  for (const s of servers) {
    s.closeAllConnections();
    s.close();
  }
});

async function listen(server: Server): Promise<string> {
  servers.push(server);
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

interface Recorded {
  digest: string;
  answer: unknown;
}

/** The public API's turn semantics, as specified, in memory. */
async function journalServer(): Promise<{ url: string; runs: string[]; requests: { method: string; url: string; headers: IncomingHttpHeaders }[]; running: Map<string, string>; queueFullOnce: Set<string> }> {
  const recorded = new Map<string, Recorded>();
  const runs: string[] = [];
  const requests: { method: string; url: string; headers: IncomingHttpHeaders }[] = [];
  const running = new Map<string, string>();
  const queueFullOnce = new Set<string>();
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => {
      requests.push({ method: req.method ?? "", url: req.url ?? "", headers: req.headers });
      const [status, body, headers] = answer(req.method, req.url, req.headers, Buffer.concat(chunks));
      res.writeHead(status, { "content-type": "application/json", ...headers });
      res.end(JSON.stringify(body));
    });
  });
  type Answer = [number, unknown, Record<string, string>?];
  const answer = (method: string | undefined, url: string | undefined, headers: IncomingHttpHeaders, body: Buffer): Answer => {
    const m = /^\/v1\/sessions\/([^/]+)\/(turns|events)$/.exec(url ?? "");
    if (method !== "POST" || !m) return [404, { error: "not_found" }];
    const session = m[1] as string;
    const key = String(headers["idempotency-key"]);
    if (queueFullOnce.delete(session)) return [503, { error: "queue_full", retry: { delay_ms: 20, budget_ms: 5000 } }, { "retry-after": "1" }];
    const busy = running.get(session);
    if (busy !== undefined && headers["leasehold-multitask"] === "reject") return [409, { error: "busy", turn_id: busy }];
    const digest = createHash("sha256").update(body).digest("hex");
    const seen = recorded.get(`${session}/${key}`);
    if (seen !== undefined) {
      if (seen.digest !== digest) return [422, { error: "idempotency_key_reused" }];
      return [200, seen.answer, { "leasehold-replayed": "true" }];
    }
    runs.push(key);
    const ran = { ran: JSON.parse(body.toString()) as unknown, run: runs.length };
    recorded.set(`${session}/${key}`, { digest, answer: ran });
    return [200, ran, { "leasehold-epoch": "1", "leasehold-owner": "n" }];
  };
  return { url: await listen(server), runs, requests, running, queueFullOnce };
}

test("a repeated key is replayed once run; reused with another body it is IdempotencyKeyReused", async () => {
  const server = await journalServer();
  const client = new Client(server.url);
  const first = await client.sendTurn("s", { text: "pay" }, { idempotencyKey: "order-7" });
  const again = await client.sendTurn("s", { text: "pay" }, { idempotencyKey: "order-7" });
  const event = await client.sendEvent("s", { name: "paid" });
  await assert.rejects(client.sendTurn("s", { text: "refund" }, { idempotencyKey: "order-7" }), (e: unknown) => e instanceof IdempotencyKeyReused && e.idempotencyKey === "order-7");
  assert.deepEqual([first.replayed, again.replayed, event.replayed], [false, true, false]);
  assert.deepEqual(await again.json(), await first.json());
  assert.deepEqual(server.runs, ["order-7", event.idempotencyKey], "ran once");
  assert.match(event.idempotencyKey, /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/, "a UUID v4 by default");
});

test("multitask is sent; busy is Busy with the running turn; queue_full is a directive", async () => {
  const server = await journalServer();
  server.running.set("busy", "t-running");
  server.queueFullOnce.add("queued");
  const client = new Client(server.url);
  await assert.rejects(client.sendTurn("busy", { text: "x" }, { multitask: "reject" }), (e: unknown) => e instanceof Busy && e.turnId === "t-running");
  const queued = await client.sendTurn("queued", { text: "y" }, { multitask: "enqueue" });
  assert.deepEqual(queued.directives, ["queue_full"]);
  assert.deepEqual(
    server.requests.map((r) => r.headers["leasehold-multitask"]),
    ["reject", "enqueue", "enqueue"],
  );
  assert.deepEqual(
    server.requests.filter((r) => r.url.includes("/queued/")).map((r) => r.headers["idempotency-key"]),
    [queued.idempotencyKey, queued.idempotencyKey],
  );
});

// -- the agent side: resume and cancel, with a fake agent API -------------------------

interface SidecarCall {
  method: string;
  url: string;
  epoch: string | null;
  body: string;
}

/** The agent API as a `fetch`: records calls, serves `journal` for a turn's events. */
function fakeSidecar(
  journal: unknown[],
  checkpoint?: unknown,
): { fetch: typeof fetch; calls: SidecarCall[]; published: [string, unknown][]; checkpoints: unknown[]; firstStep: Promise<void>; checkpointTurn: { value: string | undefined } } {
  const calls: SidecarCall[] = [];
  const published: [string, unknown][] = [];
  const checkpoints: unknown[] = [];
  let stored = checkpoint;
  const checkpointTurn: { value: string | undefined } = { value: undefined };
  let stepped!: () => void;
  const firstStep = new Promise<void>((resolve) => {
    stepped = resolve;
  });
  const fake = async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
    const url = new URL(typeof input === "string" || input instanceof URL ? input : input.url);
    const method = init?.method ?? "GET";
    const epoch = new Headers(init?.headers).get("leasehold-epoch");
    const body = typeof init?.body === "string" ? init.body : "";
    calls.push({ method, url: url.pathname, epoch, body });
    await Promise.resolve();
    if (method === "GET" && url.pathname.endsWith("/events")) return Response.json(journal);
    if (method === "POST" && url.pathname.endsWith("/events")) {
      const { type, data } = JSON.parse(body) as { type: string; data: unknown };
      published.push([type, data]);
      if (type === "step") stepped();
      return Response.json({ id: `2-${String(published.length)}` }, { status: 202 });
    }
    if (url.pathname.endsWith("/checkpoint") && method === "PUT") {
      stored = JSON.parse(body) as unknown;
      checkpoints.push(stored);
      return new Response(null, { status: 204 });
    }
    if (url.pathname.endsWith("/checkpoint")) {
      if (stored === undefined) return new Response(null, { status: 404 });
      const headers: Record<string, string> = { "leasehold-checkpoint-epoch": "1" };
      if (checkpointTurn.value !== undefined) headers["leasehold-checkpoint-turn"] = checkpointTurn.value;
      return Response.json(stored, { headers });
    }
    return new Response(null, { status: 404 });
  };
  return { fetch: fake, calls, published, checkpoints, firstStep, checkpointTurn };
}

async function post(url: string, path: string, headers: Record<string, string> = {}): Promise<{ status: number; body: unknown }> {
  const response = await fetch(url + path, { method: "POST", headers: { "content-type": "application/json", ...headers }, body: "{}" });
  const text = await response.text();
  return { status: response.status, body: text === "" ? undefined : (JSON.parse(text) as unknown) };
}

test("a resumed turn reads its journal at its epoch and publishes only the rest", async () => {
  const sidecar = fakeSidecar([
    { id: "1-1", type: "turn_started", data: { text: "hi" } },
    { id: "1-2", type: "token", data: { i: 0 } },
    { id: "1-3", type: "token", data: { i: 1 } },
  ]);
  const agent = createAgentHandler({
    sidecarUrl: "http://sidecar.invalid",
    fetch: sidecar.fetch,
    onTurn: async (session: Session) => {
      let done = 0;
      if (session.resumed) done = (await session.journalEvents()).filter((e) => e.type === "token").length;
      else await session.publish("turn_started", { text: "hi" });
      for (let i = done; i < 4; i++) await session.publish("token", { i });
      return { resumed: session.resumed, skipped: done, of: session.resumeOf ?? null };
    },
  });
  const url = await listen(createServer(agent));
  const headers = { "leasehold-epoch": "2", "leasehold-turn-id": "t-9" };
  const resumed = await post(url, "/sessions/s/turns", { ...headers, "leasehold-resume": "t-9" });
  assert.deepEqual(resumed, { status: 200, body: { resumed: true, skipped: 2, of: "t-9" } });
  assert.deepEqual(
    sidecar.published,
    [
      ["token", { i: 2 }],
      ["token", { i: 3 }],
    ],
    "no turn_started again",
  );
  const reads = sidecar.calls.filter((c) => c.method === "GET" && c.url.endsWith("/events"));
  assert.deepEqual(
    reads.map((c) => [c.url, c.epoch]),
    [["/v1/sessions/s/turns/t-9/events", "2"]],
  );
  const fresh = await post(url, "/sessions/s/turns", headers);
  assert.deepEqual(fresh.body, { resumed: false, skipped: 0, of: null });
});

test("cancel aborts the turn's signal with Interrupted, calls onCancel, stops its writes, and answers once it settled", async () => {
  const sidecar = fakeSidecar([]);
  let started!: () => void;
  const isRunning = new Promise<void>((resolve) => {
    started = resolve;
  });
  const seen: Record<string, unknown> = {};
  const cancels: [string, string][] = [];
  const agent = createAgentHandler({
    sidecarUrl: "http://sidecar.invalid",
    fetch: sidecar.fetch,
    onCancel: (key, turnId) => {
      cancels.push([key, turnId]);
    },
    onTurn: async (session: Session) => {
      await session.publish("turn_started", {});
      started();
      await new Promise<void>((resolve) => {
        session.signal.addEventListener("abort", () => {
          resolve();
        });
      }); // a long turn, until aborted
      seen.reason = session.signal.reason instanceof Interrupted;
      try {
        await session.publish("token", { late: true });
        seen.late = "sent";
      } catch (error) {
        seen.late = error instanceof Interrupted ? "interrupted" : String(error);
      }
      return { finished: true };
    },
  });
  const url = await listen(createServer(agent));
  const turn = post(url, "/sessions/s/turns", { "leasehold-epoch": "1", "leasehold-turn-id": "t-1" });
  await isRunning;
  const cancel = await post(url, "/sessions/s/turns/t-1/cancel");
  assert.equal(cancel.status, 204);
  assert.equal(seen.late, "interrupted", "answered once the handler settled");
  assert.deepEqual(await turn, { status: 409, body: { error: "interrupted" } });
  assert.equal(seen.reason, true);
  assert.deepEqual(cancels, [["s", "t-1"]]);
  assert.equal((await post(url, "/sessions/s/turns/t-unknown/cancel")).status, 204);
  assert.deepEqual(cancels, [["s", "t-1"]], "onCancel only for a running turn");
  assert.deepEqual(sidecar.published, [["turn_started", {}]], "nothing published after the cancel");
});

test("the resumable example (docs) resumes once, appends once, and stops when cancelled", async () => {
  const journal = [
    { id: "1-1", type: "turn_started", data: { text: "go" } },
    { id: "1-2", type: "step", data: { i: 0, result: "result 0" } },
    { id: "1-3", type: "step", data: { i: 1, result: "result 1" } },
  ];
  const resumeHeaders = { "leasehold-epoch": "2", "leasehold-turn-id": "t-1", "leasehold-resume": "t-1" };
  const post4 = (url: string, body: unknown, headers: Record<string, string>): Promise<Response> =>
    fetch(`${url}/sessions/s/turns`, { method: "POST", headers: { "content-type": "application/json", ...headers }, body: JSON.stringify(body) });

  const resumed = fakeSidecar(journal, { history: ["before"] });
  const a = await listen(createServer(createAgentHandler({ onTurn: exampleOnTurn, sidecarUrl: "http://sidecar.invalid", fetch: resumed.fetch })));
  assert.deepEqual(await (await post4(a, { text: "go", steps: 4 }, resumeHeaders)).json(), { history_len: 2, resumed: true });
  assert.deepEqual(
    resumed.published.map(([type, data]) => [type, (data as { i?: number }).i]),
    [
      ["step", 2],
      ["step", 3],
      ["turn_finished", undefined],
    ],
  );
  assert.deepEqual(resumed.checkpoints, [{ history: ["before", "go"], lastTurn: "t-1" }]);

  const finished = fakeSidecar([...journal.slice(0, 2), { id: "1-4", type: "turn_finished", data: {} }], { history: ["before", "go"], lastTurn: "t-1" });
  const b = await listen(createServer(createAgentHandler({ onTurn: exampleOnTurn, sidecarUrl: "http://sidecar.invalid", fetch: finished.fetch })));
  assert.deepEqual(await (await post4(b, { text: "go", steps: 1 }, resumeHeaders)).json(), { history_len: 2, resumed: true });
  assert.deepEqual([finished.published, finished.checkpoints], [[], []], "the first attempt did it all");

  const cancelled = fakeSidecar([]);
  const c = await listen(createServer(createAgentHandler({ onTurn: exampleOnTurn, onCancel: exampleOnCancel, sidecarUrl: "http://sidecar.invalid", fetch: cancelled.fetch })));
  const turn = post4(c, { text: "x", steps: 1000 }, { "leasehold-epoch": "1", "leasehold-turn-id": "t-2" });
  await cancelled.firstStep;
  assert.equal((await post(c, "/sessions/s/turns/t-2/cancel")).status, 204);
  const stoppedAt = cancelled.published.length;
  const answer = await turn;
  assert.deepEqual([answer.status, await answer.json()], [409, { error: "interrupted" }]);
  assert.equal(cancelled.published.length, stoppedAt, "nothing published after the cancel");
  assert.ok(stoppedAt < 1000);
  assert.deepEqual(cancelled.checkpoints, []);
});

/** The fake agent API as a real server on loopback (for an agent in another process). */
async function fakeSidecarServer(journal: unknown[], checkpoint?: unknown): Promise<{ url: string; published: [string, unknown][]; checkpoints: unknown[] }> {
  const fake = fakeSidecar(journal, checkpoint);
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => {
      const headers: Record<string, string> = {};
      for (const [name, value] of Object.entries(req.headers)) if (typeof value === "string") headers[name] = value;
      const body = Buffer.concat(chunks).toString();
      const init: RequestInit = { method: req.method ?? "GET", headers, ...(body === "" ? {} : { body }) };
      void fake.fetch(`http://sidecar${req.url ?? "/"}`, init).then(async (answer) => {
        res.writeHead(answer.status, { "content-type": "application/json" });
        res.end(await answer.text());
      });
    });
  });
  return { url: await listen(server), published: fake.published, checkpoints: fake.checkpoints };
}

test("the TypeScript demo agent resumes like the Rust one: no second turn_started, only the tokens not journaled", async () => {
  const sidecar = await fakeSidecarServer(
    [
      { id: "1-1", type: "turn_started", data: { text: "hi" } },
      { id: "1-2", type: "token", data: { i: 0, text: "tok0" } },
      { id: "1-3", type: "token", data: { i: 1, text: "tok1" } },
    ],
    { history: ["before"] },
  );
  const port = await new Promise<number>((resolve) => {
    const probe = createServer();
    probe.listen(0, "127.0.0.1", () => {
      const { port: free } = probe.address() as AddressInfo;
      probe.close(() => {
        resolve(free);
      });
    });
  });
  const script = fileURLToPath(new URL("../examples/demo-agent.js", import.meta.url));
  const child = spawn(process.execPath, [script, "--listen", `127.0.0.1:${String(port)}`, "--sidecar-url", sidecar.url, "--node-id", "node-ts"], { stdio: ["ignore", "ignore", "pipe"] });
  try {
    await new Promise<void>((resolve, reject) => {
      let err = "";
      child.stderr.on("data", (chunk: Buffer) => {
        err += chunk.toString();
        if (err.includes("demo agent ready")) resolve();
      });
      child.on("exit", (code) => {
        reject(new Error(`demo agent exited ${String(code)}: ${err}`));
      });
    });
    const headers = { "leasehold-epoch": "2", "leasehold-turn-id": "t-9", "leasehold-resume": "t-9" };
    const response = await fetch(`http://127.0.0.1:${String(port)}/sessions/s/turns`, { method: "POST", headers: { "content-type": "application/json", ...headers }, body: JSON.stringify({ text: "hi" }) });
    assert.deepEqual(await response.json(), { history_len: 2, epoch: 2, node: "node-ts" });
    assert.deepEqual(
      sidecar.published.map(([type, data]) => [type, (data as { i?: number }).i]),
      [
        ["token", 2],
        ["token", 3],
        ["token", 4],
        ["turn_finished", undefined],
      ],
    );
    assert.deepEqual(sidecar.checkpoints, [{ history: ["before", "hi"], last_turn: "t-9" }]);
  } finally {
    child.kill("SIGKILL");
  }
});

test("thaw() reads the turn that wrote the checkpoint (Leasehold-Checkpoint-Turn)", async () => {
  const sidecar = fakeSidecar([], { history: ["a"] });
  sidecar.checkpointTurn.value = "t-7";
  const seen: [number | undefined, string | undefined][] = [];
  const agent = createAgentHandler({
    sidecarUrl: "http://sidecar.invalid",
    fetch: sidecar.fetch,
    onTurn: async (session: Session) => {
      const thawed = await session.thaw();
      seen.push([thawed?.epoch, thawed?.turnId]);
      return {};
    },
  });
  const url = await listen(createServer(agent));
  const headers = { "leasehold-epoch": "2", "leasehold-turn-id": "t-7", "leasehold-resume": "t-7" };
  await post(url, "/sessions/s/turns", headers);
  sidecar.checkpointTurn.value = undefined; // written between turns
  await post(url, "/sessions/s/turns", headers);
  assert.deepEqual(seen, [
    [1, "t-7"],
    [1, undefined],
  ]);
});
