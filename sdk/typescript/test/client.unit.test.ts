/**
 * The client's retry rules and error mapping against a scripted HTTP server on
 * 127.0.0.1 (the real sidecar cannot be made to send every answer on demand), and the
 * SSE parser on hand-made chunks.
 */

import assert from "node:assert/strict";
import { createServer, type IncomingHttpHeaders, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { after, test } from "node:test";

import {
  Busy,
  Client,
  ConnectionError,
  Fenced,
  HttpError,
  IdempotencyKeyReused,
  Interrupted,
  OwnerFailed,
  RetryBudgetExhausted,
  SseParser,
  StreamOverflow,
  type LeaseholdEvent,
  type ReconnectInfo,
} from "../src/index.js";

interface Seen {
  method: string;
  url: string;
  headers: IncomingHttpHeaders;
  body: string;
  at: number;
}

type Script = (res: ServerResponse, seen: Seen, n: number) => void;

const servers: { close: () => void }[] = [];
after(() => {
  for (const s of servers) s.close();
});

/** A server answering its n-th request with `script[n]` (the last one repeats). */
async function scripted(script: Script[]): Promise<{ url: string; seen: Seen[] }> {
  const seen: Seen[] = [];
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => {
      const entry = { method: req.method ?? "", url: req.url ?? "", headers: req.headers, body: Buffer.concat(chunks).toString(), at: Date.now() };
      seen.push(entry);
      const step = script[Math.min(seen.length - 1, script.length - 1)];
      step?.(res, entry, seen.length - 1);
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  servers.push({
    close: () => {
      server.closeAllConnections();
      server.close();
    },
  });
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, seen };
}

const json =
  (status: number, body: unknown, headers: Record<string, string> = {}): Script =>
  (res) => {
    res.writeHead(status, { "content-type": "application/json", ...headers });
    res.end(JSON.stringify(body));
  };

const ok = json(200, { ok: true }, { "leasehold-owner": "node-x", "leasehold-epoch": "3" });

test("a directive is re-sent after delay_ms with the same Idempotency-Key", async () => {
  const { url, seen } = await scripted([json(503, { error: "draining", retry: { delay_ms: 150, budget_ms: 5000 } }, { "retry-after": "1" }), ok]);
  const client = new Client(url);
  const answer = await client.sendTurn("k1", { text: "hi" });
  assert.equal(answer.status, 200);
  assert.deepEqual(answer.directives, ["draining"]);
  assert.equal(answer.owner, "node-x");
  assert.equal(answer.epoch, 3);
  assert.deepEqual(await answer.json(), { ok: true });
  assert.equal(seen.length, 2);
  const [first, second] = seen as [Seen, Seen];
  assert.ok(second.at - first.at >= 140, `waited ${second.at - first.at} ms, directive said 150 (not Retry-After's 1 s)`);
  const key = first.headers["idempotency-key"];
  assert.match(String(key), /^[0-9a-f-]{36}$/);
  assert.equal(second.headers["idempotency-key"], key, "the re-send reuses the key");
  assert.equal(first.headers["leasehold-turn-id"], key);
  assert.equal(first.headers["content-type"], "application/json");
  assert.equal(second.body, JSON.stringify({ text: "hi" }));
  assert.equal(first.url, "/v1/sessions/k1/turns");

  const next = await client.sendTurn("k1", "plain", { multitask: "reject", headers: { traceparent: "00-abc" } });
  assert.equal(next.status, 200);
  const third = seen[2] as Seen;
  assert.notEqual(third.headers["idempotency-key"], key, "each turn gets a key of its own");
  assert.equal(third.headers["leasehold-multitask"], "reject");
  assert.equal(third.headers["content-type"], "text/plain; charset=utf-8");
  assert.equal(third.headers.traceparent, "00-abc");
});

test("a bare Retry-After is a directive with the client's budget", async () => {
  const { url, seen } = await scripted([(res) => res.writeHead(503, { "retry-after": "1" }).end("busy proxy"), ok]);
  const answer = await new Client(url).sendEvent("k2", { name: "e" });
  assert.equal(answer.status, 200);
  assert.deepEqual(answer.directives, ["unavailable"]);
  assert.ok((seen[1] as Seen).at - (seen[0] as Seen).at >= 950);
  assert.equal((seen[0] as Seen).url, "/v1/sessions/k2/events");

  const { url: url2 } = await scripted([(res) => res.writeHead(503, { "retry-after": "1" }).end()]);
  await assert.rejects(new Client({ baseUrls: url2, retryAfterBudgetMs: 500 }).sendTurn("k2", "x"), RetryBudgetExhausted);
});

test("no directive, no retry: a 503 without one, a 500, a 400 are surfaced after one request", async () => {
  for (const [status, body] of [
    [503, { error: "overloaded" }],
    [500, { error: "boom" }],
    [400, { error: "invalid_key" }],
  ] as const) {
    const { url, seen } = await scripted([json(status, body), ok]);
    await assert.rejects(new Client(url).sendTurn("k3", {}), (error: unknown) => {
      assert.ok(error instanceof HttpError, String(error));
      assert.equal(error.status, status);
      assert.equal(error.code, body.error);
      return true;
    });
    assert.equal(seen.length, 1, `${status}: sent once`);
  }
});

test("a directive whose delay would pass its budget gives up with RetryBudgetExhausted", async () => {
  const { url, seen } = await scripted([json(503, { error: "takeover_pending", retry: { delay_ms: 60, budget_ms: 200 } })]);
  const started = Date.now();
  await assert.rejects(new Client(url).sendTurn("k4", {}), (error: unknown) => {
    assert.ok(error instanceof RetryBudgetExhausted);
    assert.equal(error.directive?.error, "takeover_pending");
    assert.ok(error.directives.length >= 3 && error.directives.length <= 4, `${error.directives.length} attempts`);
    return true;
  });
  assert.ok(Date.now() - started < 400);
  assert.equal(new Set(seen.map((s) => s.headers["idempotency-key"])).size, 1);
});

test("502 owner_failed is re-sent with the same key a bounded number of times, unless retryOwnerFailed: false", async () => {
  const failed = json(502, { error: "owner_failed", message: "timeout" });
  const a = await scripted([failed, ok]);
  await assert.rejects(new Client({ baseUrls: a.url, retryOwnerFailed: false }).sendTurn("k5", {}), OwnerFailed);
  assert.equal(a.seen.length, 1, "turned off: no retry without a directive");

  const b = await scripted([failed, failed, json(200, { ok: true }, { "leasehold-replayed": "true" })]);
  const answer = await new Client({ baseUrls: b.url, retryOwnerFailed: { delayMs: 20, budgetMs: 1000 } }).sendTurn("k5", {}, { idempotencyKey: "order-42" });
  assert.equal(answer.status, 200);
  assert.equal(answer.replayed, true);
  assert.deepEqual(answer.directives, ["owner_failed", "owner_failed"]);
  assert.deepEqual(
    b.seen.map((s) => s.headers["idempotency-key"]),
    ["order-42", "order-42", "order-42"],
  );
  assert.equal((b.seen[0] as Seen).headers["leasehold-turn-id"], undefined, "not a UUID: no Leasehold-Turn-Id");

  // On by default: the first request and 3 re-sends, then OwnerFailed.
  const c = await scripted([failed]);
  await assert.rejects(new Client(c.url).sendEvent("k5", {}), OwnerFailed);
  assert.equal(c.seen.length, 4);
  assert.equal(new Set(c.seen.map((s) => s.headers["idempotency-key"])).size, 1);
  const d = await scripted([failed]);
  await assert.rejects(new Client({ baseUrls: d.url, retryOwnerFailed: { delayMs: 1, budgetMs: 5000, maxRetries: 1 } }).sendTurn("k5", {}), OwnerFailed);
  assert.equal(d.seen.length, 2);
});

test("a connection reset after the turn was sent is re-sent with the same key; a GET is not", async () => {
  const reset: Script = (res) => {
    res.socket?.resetAndDestroy();
  };
  const a = await scripted([reset, reset, ok]);
  const client = new Client({ baseUrls: a.url, retryOwnerFailed: { delayMs: 1, budgetMs: 5000 } });
  const answer = await client.sendTurn("k10", { text: "x" });
  assert.deepEqual(answer.directives, ["connection_lost", "connection_lost"]);
  assert.deepEqual(
    a.seen.map((s) => s.headers["idempotency-key"]),
    [answer.idempotencyKey, answer.idempotencyKey, answer.idempotencyKey],
  );
  const b = await scripted([reset]);
  await assert.rejects(new Client({ baseUrls: b.url, retryOwnerFailed: { delayMs: 1, budgetMs: 5000 } }).sendTurn("k10", {}), ConnectionError);
  assert.equal(b.seen.length, 4, "the first request and 3 re-sends");
  const c = await scripted([reset]);
  await assert.rejects(new Client({ baseUrls: c.url, retryOwnerFailed: false }).sendTurn("k10", {}), ConnectionError);
  assert.equal(c.seen.length, 1);
  const d = await scripted([reset]);
  await assert.rejects(new Client(d.url).getTurn("k10", "t-1"), ConnectionError);
  assert.equal(d.seen.length, 1, "only turns and events are re-sent");
});

test("409 and 422 answers map to their typed errors", async () => {
  const cases: [Script, (e: unknown) => boolean][] = [
    [json(409, { error: "busy", turn_id: "t-1" }), (e) => e instanceof Busy && e.turnId === "t-1"],
    [json(409, { error: "interrupted" }), (e) => e instanceof Interrupted],
    [json(409, { error: "fenced" }), (e) => e instanceof Fenced && e.via === "sidecar"],
    [json(422, { error: "idempotency_key_reused" }), (e) => e instanceof IdempotencyKeyReused && e.idempotencyKey === "k"],
  ];
  for (const [script, check] of cases) {
    const { url } = await scripted([script]);
    await assert.rejects(new Client(url).sendTurn("k6", {}, { idempotencyKey: "k" }), check);
  }
});

test("getTurn(): 404 is undefined, 200 the turn's record; cancelTurn(); session() maps the fields", async () => {
  const { url, seen } = await scripted([
    json(404, { error: "not_found" }),
    json(200, { turn_id: "t-9", state: "finished", epoch: 2, attempts: 2, answer: { status: 200, content_type: "application/json", body: '{"history_len":3}' } }),
    json(200, { key: "k7", owner: "node-b", epoch: 4, expires_in_ms: 1200, claimable: false }),
    json(200, { turn_id: "t-9", state: "cancelled", epoch: 2 }),
    json(404, { error: "not_found" }),
  ]);
  const client = new Client(url);
  assert.equal(await client.getTurn("k7", "t-8"), undefined);
  const info = await client.turn("k7", "t-9");
  assert.deepEqual(
    { ...info, raw: undefined },
    { turnId: "t-9", state: "finished", epoch: 2, attempts: 2, answer: { status: 200, contentType: "application/json", body: '{"history_len":3}' }, raw: undefined },
  );
  assert.equal((seen[1] as Seen).url, "/v1/sessions/k7/turns/t-9");
  assert.deepEqual(await client.session("k7"), { key: "k7", owner: "node-b", epoch: 4, expiresInMs: 1200, claimable: false });
  assert.equal(await client.cancelTurn("k7", "t-9"), true);
  assert.equal(await client.cancelTurn("k7", "t-0"), false);
  assert.deepEqual(
    seen.slice(3).map((s) => [s.method, s.url]),
    [
      ["DELETE", "/v1/sessions/k7/turns/t-9"],
      ["DELETE", "/v1/sessions/k7/turns/t-0"],
    ],
  );
  await assert.rejects(client.getTurn("k7", "has space"), TypeError);
  assert.throws(() => client.stream("bad/key"), TypeError);
});

const sse =
  (frames: string, end = true): Script =>
  (res) => {
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.write(frames);
    if (end) res.end();
  };

test("stream: reconnects with Last-Event-ID on `reconnect` and on a dropped connection, never repeats an id", async () => {
  const { url, seen } = await scripted([
    sse("event: idle\ndata: {}\n\nid: 1-1\nevent: token\ndata: {\"i\":0}\n\nid: 1-2\nevent: token\ndata: {\"i\":1}\n\nevent: reconnect\ndata: {}\n\n"),
    sse("id: 1-2\nevent: token\ndata: {\"i\":1}\n\nid: 2-1\nevent: turn_started\ndata: {}\n\n"), // then the connection ends
    sse("id: 1-9\nevent: stale\ndata: {}\n\nid: 2-2\nevent: token\r\ndata: line1\r\ndata: line2\r\n\r\n", false),
  ]);
  const reconnects: ReconnectInfo[] = [];
  const controls: string[] = [];
  const events: LeaseholdEvent[] = [];
  const client = new Client([url, url]);
  for await (const event of client.stream("k8", { onReconnect: (i) => reconnects.push(i), onControl: (t) => controls.push(t) })) {
    events.push(event);
    if (events.length === 4) break;
  }
  assert.deepEqual(
    events.map((e) => [e.id, e.type]),
    [
      ["1-1", "token"],
      ["1-2", "token"],
      ["2-1", "turn_started"],
      ["2-2", "token"],
    ],
  );
  assert.deepEqual(events[0]?.data, { i: 0 });
  assert.equal(events[3]?.data, "line1\nline2");
  assert.deepEqual(controls, ["idle", "reconnect"]);
  assert.deepEqual(
    reconnects.map((r) => [r.reason, r.lastEventId]),
    [
      ["reconnect", "1-2"],
      ["dropped", "2-1"],
    ],
  );
  assert.equal(seen[0]?.headers["last-event-id"], undefined);
  assert.equal(seen[1]?.headers["last-event-id"], "1-2");
  assert.equal(seen[2]?.headers["last-event-id"], "2-1");
  assert.equal(seen[0]?.headers.accept, "text/event-stream");
});

test("stream: overflow throws StreamOverflow unless resumeOnOverflow", async () => {
  const overflow = sse('id: 3-1\nevent: token\ndata: {}\n\nevent: overflow\ndata: {"missed":7,"last_event_id":"3-1"}\n\n');
  const a = await scripted([overflow]);
  const got: string[] = [];
  await assert.rejects(
    (async () => {
      for await (const e of new Client(a.url).stream("k9", { lastEventId: "2-5" })) got.push(e.id);
    })(),
    (error: unknown) => error instanceof StreamOverflow && error.lastEventId === "3-1" && error.missed === 7,
  );
  assert.deepEqual(got, ["3-1"]);
  assert.equal(a.seen[0]?.headers["last-event-id"], "2-5");

  const b = await scripted([overflow, sse("id: 3-2\nevent: token\ndata: {}\n\n", false)]);
  const ids: string[] = [];
  for await (const e of new Client(b.url).stream("k9", { resumeOnOverflow: true })) {
    ids.push(e.id);
    if (ids.length === 2) break;
  }
  assert.deepEqual(ids, ["3-1", "3-2"]);
  assert.equal(b.seen[1]?.headers["last-event-id"], "3-1");
});

test("SseParser: frames split anywhere, CR/LF/CRLF line ends, comments, multi-line data, retry", () => {
  const text = ": keep-alive\n\nid: 1-1\nevent: tok\r\ndata: a\rdata:b\n\nretry: 1500\n\nevent: idle\ndata: {}\n\n";
  const whole = new SseParser().feed(text);
  for (let cut = 1; cut < text.length; cut++) {
    const parser = new SseParser();
    const frames = [...parser.feed(text.slice(0, cut)), ...parser.feed(text.slice(cut))];
    assert.deepEqual(frames, whole, `cut at ${cut}`);
  }
  assert.deepEqual(whole, [
    { id: "1-1", event: "tok", data: "a\nb", retry: undefined },
    { id: undefined, event: "message", data: "", retry: 1500 },
    { id: undefined, event: "idle", data: "{}", retry: undefined },
  ]);
  // Bytes: a multi-byte character split across chunks.
  const bytes = new TextEncoder().encode("data: é\n\n");
  const parser = new SseParser();
  const frames = [...parser.push(bytes.slice(0, 7)), ...parser.push(bytes.slice(7))];
  assert.equal(frames[0]?.data, "é");
});
