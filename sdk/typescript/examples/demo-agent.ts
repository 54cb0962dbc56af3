#!/usr/bin/env node
/**
 * The TypeScript twin of `leasehold-demo-agent` (docs/http-api.md, the demo agent), written with
 * `@leasehold/sdk/agent`: what a user copies to write their own agent.
 *
 * A turn's body is `{"text": "...", "think_ms": 0, "tokens": 5}` (all optional). For
 * each turn it thaws `{"history":[...]}` unless it holds it at this epoch already,
 * publishes `turn_started`, `tokens` × `token` spread over `think_ms`, `turn_finished`,
 * appends `text` to the history, checkpoints, and answers
 * `200 {"history_len", "epoch", "node"}`. A fenced write stops it at once:
 * `409 {"error":"fenced"}` (the SDK answers that when `Fenced` is thrown). Events are
 * handled like turns with `event:<name>` appended. A resumed turn (`Leasehold-Resume`)
 * publishes no second `turn_started` and only the tokens its earlier attempts did not
 * journal; a cancelled one stops at once (the SDK answers `409 interrupted`).
 *
 *   node dist/examples/demo-agent.js --listen 127.0.0.1:3000 --sidecar-url http://127.0.0.1:8082
 */

import { createServer } from "node:http";
import { hostname } from "node:os";
import { setTimeout as sleep } from "node:timers/promises";
import { parseArgs } from "node:util";

import { AgentError, createAgentHandler, type AgentRequest, type Session } from "@leasehold/sdk/agent";

interface Input {
  text?: string;
  /** For events: recorded as `event:<name>`. */
  name?: string;
  think_ms?: number;
  tokens?: number;
}

interface State {
  history: string[];
  /** The turn whose entry is the last of `history`: a resume must not append it twice. */
  last_turn?: string;
}

/** Tokens published when the body does not say. */
const DEFAULT_TOKENS = 5;
/** Upper bound on `think_ms`, so one request cannot park a turn for hours. */
const MAX_THINK_MS = 600_000;

function usage(): never {
  console.error("usage: demo-agent [--listen HOST:PORT] [--sidecar-url URL] [--node-id NAME]");
  process.exit(2);
}

const { values } = (() => {
  try {
    return parseArgs({
      options: {
        listen: { type: "string" },
        "sidecar-url": { type: "string" },
        "node-id": { type: "string" },
        help: { type: "boolean", short: "h" },
      },
      strict: true,
    });
  } catch (error) {
    console.error(`demo-agent: ${error instanceof Error ? error.message : String(error)}`);
    return usage();
  }
})();
if (values.help) usage();

const listen = values.listen ?? process.env.DEMO_AGENT_LISTEN ?? "127.0.0.1:3000";
const sidecarUrl = values["sidecar-url"] ?? process.env.LEASEHOLD_SIDECAR_URL ?? "http://127.0.0.1:8082";
// Like the Rust agent: --node-id, $LEASEHOLD_NODE_ID, $POD_NAME, $HOSTNAME, else "demo".
const nodeId = values["node-id"] ?? process.env.LEASEHOLD_NODE_ID ?? process.env.POD_NAME ?? process.env.HOSTNAME ?? (hostname() || "demo");

function parseInput(request: AgentRequest): Input {
  const input = request.json();
  if (typeof input !== "object" || input === null || Array.isArray(input)) {
    throw new AgentError(400, "malformed_json", "the body must be a JSON object");
  }
  const { text, name, think_ms: thinkMs, tokens } = input as Record<string, unknown>;
  const bad = (field: string, what: string): never => {
    throw new AgentError(400, "malformed_json", `${field} must be ${what}`);
  };
  if (text !== undefined && text !== null && typeof text !== "string") bad("text", "a string");
  if (name !== undefined && name !== null && typeof name !== "string") bad("name", "a string");
  if (thinkMs !== undefined && thinkMs !== null && !(Number.isInteger(thinkMs) && (thinkMs as number) >= 0)) bad("think_ms", "a non-negative integer");
  if (tokens !== undefined && tokens !== null && !(Number.isInteger(tokens) && (tokens as number) >= 0)) bad("tokens", "a non-negative integer");
  return {
    ...(typeof text === "string" ? { text } : {}),
    ...(typeof name === "string" ? { name } : {}),
    ...(typeof thinkMs === "number" ? { think_ms: thinkMs } : {}),
    ...(typeof tokens === "number" ? { tokens } : {}),
  };
}

/** The checkpointed state, or a fresh one. A checkpoint of another shape stops the turn. */
async function thaw(session: Session): Promise<State> {
  const checkpoint = await session.thaw();
  if (checkpoint === undefined) return { history: [] };
  let state: unknown;
  try {
    state = checkpoint.json();
  } catch (error) {
    throw new AgentError(500, "bad_checkpoint", `the checkpoint is not JSON: ${String(error)}`);
  }
  const history = (state as { history?: unknown } | null)?.history;
  if (!Array.isArray(history) || !history.every((h) => typeof h === "string")) {
    throw new AgentError(500, "bad_checkpoint", 'the checkpoint is not {"history":[...]}');
  }
  const lastTurn = (state as { last_turn?: unknown }).last_turn;
  return typeof lastTurn === "string" ? { history, last_turn: lastTurn } : { history };
}

/** Where a resumed turn picks up: the first token index not journaled, and whether it finished. */
async function progress(session: Session): Promise<{ next: number; finished: boolean }> {
  if (!session.resumed) return { next: 0, finished: false };
  let next = 0;
  let counted = 0;
  let finished = false;
  for (const event of await session.journalEvents()) {
    if (event.type === "turn_finished") finished = true;
    if (event.type !== "token") continue;
    counted += 1;
    const i = (event.data as { i?: unknown } | null)?.i;
    if (typeof i === "number" && Number.isInteger(i)) next = Math.max(next, i + 1);
  }
  return { next: Math.max(next, counted), finished };
}

async function turn(session: Session, request: AgentRequest): Promise<unknown> {
  const input = parseInput(request);
  // Held in memory between turns at this epoch; the SDK drops it on a new epoch, a
  // stand-down, or a failed turn.
  let state = session.memory.get("state") as State | undefined;
  if (state === undefined) {
    state = await thaw(session);
    session.memory.set("state", state);
  }
  const entry = session.kind === "event" ? `event:${input.name ?? "event"}` : (input.text ?? "");
  // A resumed turn (Leasehold-Resume) publishes only what its earlier attempts did not.
  const done = await progress(session);
  // ... and does not append its entry again if an earlier attempt checkpointed it.
  const checkpointed = session.resumed && state.last_turn === session.turnId;
  if (!session.resumed) await session.publish("turn_started", { text: entry, node: nodeId });
  const tokens = input.tokens ?? DEFAULT_TOKENS;
  const think = Math.min(input.think_ms ?? 0, MAX_THINK_MS);
  const pause = tokens === 0 ? think : think / tokens;
  for (let i = done.next; i < tokens; i++) {
    // Aborted by a stand-down (fenced) or a cancel (interrupted): the SDK answers with the reason.
    await sleep(pause, undefined, { signal: session.signal });
    await session.publish("token", { i, text: `tok${i}` });
  }
  if (tokens === 0) await sleep(pause, undefined, { signal: session.signal });
  const historyLen = state.history.length + (checkpointed ? 0 : 1);
  if (!done.finished) await session.publish("turn_finished", { history_len: historyLen });
  if (!checkpointed) {
    const next: State = { history: [...state.history, entry], last_turn: session.turnId };
    await session.checkpoint(next);
    session.memory.set("state", next);
  }
  return { history_len: historyLen, epoch: session.epoch, node: nodeId };
}

const agent = createAgentHandler({ onTurn: turn, sidecarUrl });

const server = createServer((req, res) => {
  // Operator/test hook, as in the Rust agent: the session idled out; release it now.
  const release = /^\/sessions\/([^/]+)\/release$/.exec(req.url ?? "");
  if (req.method === "POST" && release?.[1] !== undefined) {
    req.resume();
    agent.release(decodeURIComponent(release[1])).then(
      () => {
        res.writeHead(204).end();
      },
      (error: unknown) => {
        const body = JSON.stringify({ error: "release_failed", message: String(error) });
        res.writeHead(409, { "content-type": "application/json" }).end(body);
      },
    );
    return;
  }
  agent(req, res);
});
// Node closes idle keep-alive connections after 5 s; the sidecar reuses them for 1 s.
server.keepAliveTimeout = 5_000;

const at = listen.lastIndexOf(":");
const host = listen.slice(0, at).replace(/^\[|\]$/g, "");
const port = Number(listen.slice(at + 1));
if (at < 0 || !Number.isInteger(port)) {
  console.error(`demo-agent: --listen: expected HOST:PORT, got ${listen}`);
  process.exit(2);
}
server.on("error", (error) => {
  console.error(`demo-agent: --listen: cannot listen on ${listen}: ${error.message}`);
  process.exit(1);
});
server.listen(port, host, () => {
  console.error(`demo agent ready: listen=${listen} sidecar=${sidecarUrl} node=${nodeId}`);
});
for (const signal of ["SIGTERM", "SIGINT"] as const) {
  process.on(signal, () => {
    server.close();
    process.exit(0);
  });
}
