/**
 * `@leasehold/sdk/agent`: the agent side of leasehold (docs/http-api.md, the agent contract and §5).
 *
 * `createAgentHandler({ onTurn })` returns a `node:http` request handler that serves
 * the routes the sidecar calls (`POST /sessions/{key}/turns`, `/events`, `/stand-down`,
 * `/sessions/{key}/turns/{turnId}/cancel`). The author writes
 * `async (session, request) => answer`; `session` thaws, checkpoints, publishes and
 * releases through the sidecar's agent API with the turn's epoch, and its `signal`
 * aborts when the sidecar stands the session down or cancels the turn.
 *
 * Resume: a turn re-dispatched after its owner was lost mid-turn has `session.resumed`
 * (`Leasehold-Resume`); `await session.journalEvents()` is what its earlier attempts
 * published, which watchers already saw (then `turn_resumed`): publish only the rest,
 * and no second `turn_started`.
 *
 * Cancel: `POST /sessions/{key}/turns/{turnId}/cancel` (a newer turn interrupted this
 * one) aborts `session.signal` with {@link Interrupted}, calls `onCancel`, and is
 * answered `204` once the handler has settled (at most 3 s); from then on the session's
 * writes throw without being sent, so nothing more of the turn is published.
 */

import type { IncomingMessage, ServerResponse } from "node:http";
import { Readable } from "node:stream";

import { ConnectionError, Fenced, Interrupted, SidecarRefused, errorCode } from "./errors.js";
import { checkKey, describe, neverSent, trimBase } from "./internal.js";

export { ConnectionError, Fenced, HttpError, Interrupted, LeaseholdError, SidecarRefused } from "./errors.js";

/** The client headers the sidecar forwards by default (`--forward-headers`, docs/http-api.md, configuration). */
export const DEFAULT_FORWARD_HEADERS: readonly string[] = ["authorization", "traceparent", "tracestate", "baggage", "x-request-id", "accept"];

const DEFAULT_SIDECAR_URL = "http://127.0.0.1:8082";

/**
 * An error with an HTTP answer of the author's choosing: thrown out of `onTurn`, it is
 * answered `status {"error": code, "message": message}`.
 */
export class AgentError extends Error {
  readonly status: number;
  readonly code: string;

  constructor(status: number, code: string, message: string) {
    super(message);
    this.name = "AgentError";
    this.status = status;
    this.code = code;
  }
}

/** A checkpoint as read back: the bytes and the epoch that wrote them. */
export interface Thawed {
  bytes: Uint8Array;
  /** `Leasehold-Checkpoint-Epoch`. */
  epoch: number | undefined;
  /**
   * `Leasehold-Checkpoint-Turn`: the turn that wrote it, when written during a turn. A
   * resumed turn finds its own id here if its earlier attempt's checkpoint landed.
   */
  turnId: string | undefined;
  text(): string;
  json<T = unknown>(): T;
}

/** One journaled event of an earlier attempt of a turn (docs/http-api.md, the agent API). */
export interface JournalEvent {
  id: string;
  type: string;
  data: unknown;
}

export type CheckpointState = Uint8Array | string | object;

/** The sidecar's agent API (docs/http-api.md, the agent API), one call per method. Writes carry the epoch. */
export class SidecarApi {
  readonly baseUrl: string;
  private readonly fetch: typeof fetch;

  constructor(baseUrl: string = process.env.LEASEHOLD_SIDECAR_URL ?? DEFAULT_SIDECAR_URL, fetchImpl?: typeof fetch) {
    this.baseUrl = trimBase(baseUrl);
    this.fetch = fetchImpl ?? ((input, init) => globalThis.fetch(input, init));
  }

  private url(key: string, rest: string): string {
    return `${this.baseUrl}/v1/sessions/${encodeURIComponent(checkKey(key))}/${rest}`;
  }

  private async send(url: string, init: RequestInit): Promise<Response> {
    try {
      return await this.fetch(url, init);
    } catch (error) {
      if (init.signal?.aborted) throw error;
      const code = neverSent(error) ? "unreachable" : "connection_failed";
      throw new ConnectionError(code, `sidecar agent API ${url}: ${describe(error)}`, error);
    }
  }

  /** A refusal: `409` is always `fenced` on a write; anything else is passed back as is. */
  private static async refused(response: Response, write: boolean): Promise<Error> {
    const body = await response.text();
    if (write && response.status === 409) return new Fenced("sidecar");
    return new SidecarRefused(response.status, response.headers, body, { code: errorCode(body) ?? "sidecar_refused" });
  }

  async getCheckpoint(key: string, signal?: AbortSignal): Promise<Thawed | undefined> {
    const response = await this.send(this.url(key, "checkpoint"), { signal: signal ?? null });
    if (response.status === 404) {
      await response.body?.cancel();
      return undefined;
    }
    if (!response.ok) throw await SidecarApi.refused(response, false);
    const bytes = new Uint8Array(await response.arrayBuffer());
    const epoch = response.headers.get("leasehold-checkpoint-epoch");
    return thawed(bytes, epoch === null ? undefined : Number(epoch), response.headers.get("leasehold-checkpoint-turn") ?? undefined);
  }

  async putCheckpoint(key: string, epoch: number, state: CheckpointState): Promise<void> {
    const [body, contentType] =
      state instanceof Uint8Array
        ? [state, "application/octet-stream"]
        : typeof state === "string"
          ? [state, "text/plain; charset=utf-8"]
          : [JSON.stringify(state), "application/json"];
    const response = await this.send(this.url(key, "checkpoint"), {
      method: "PUT",
      headers: { "leasehold-epoch": String(epoch), "content-type": contentType },
      body,
    });
    if (!response.ok) throw await SidecarApi.refused(response, true);
    await response.body?.cancel();
  }

  /** Publish to every observer on every node; the event's id (`<epoch>-<seq>`). */
  async publish(key: string, epoch: number, type: string, data: unknown): Promise<string> {
    const response = await this.send(this.url(key, "events"), {
      method: "POST",
      headers: { "leasehold-epoch": String(epoch), "content-type": "application/json" },
      body: JSON.stringify({ type, data: data ?? null }),
    });
    if (!response.ok) throw await SidecarApi.refused(response, true);
    const answer = (await response.json()) as { id?: unknown };
    return typeof answer.id === "string" ? answer.id : "";
  }

  /**
   * `GET /v1/sessions/{key}/turns/{turnId}/events` with `Leasehold-Epoch: epoch`: the
   * journaled events of the turn's attempts at epochs below `epoch`, oldest first. `404`
   * (no such turn, or a sidecar without the journal) is `[]`.
   */
  async journalEvents(key: string, turnId: string, epoch?: number, signal?: AbortSignal): Promise<JournalEvent[]> {
    const headers: Record<string, string> = epoch === undefined ? {} : { "leasehold-epoch": String(epoch) };
    const response = await this.send(this.url(key, `turns/${encodeURIComponent(turnId)}/events`), { headers, signal: signal ?? null });
    if (response.status === 404) {
      await response.body?.cancel();
      return [];
    }
    if (!response.ok) throw await SidecarApi.refused(response, false);
    const list: unknown = await response.json();
    if (!Array.isArray(list)) throw new SidecarRefused(response.status, response.headers, JSON.stringify(list), { code: "malformed_journal" });
    return list.map((e: unknown) => {
      const { id, type, data } = (e ?? {}) as { id?: unknown; type?: unknown; data?: unknown };
      return { id: String(id), type: String(type), data };
    });
  }

  /** `DELETE /v1/sessions/{key}/lease`: the session idled out; claimable at once. */
  async release(key: string, epoch: number): Promise<void> {
    const response = await this.send(this.url(key, "lease"), { method: "DELETE", headers: { "leasehold-epoch": String(epoch) } });
    if (!response.ok) throw await SidecarApi.refused(response, true);
    await response.body?.cancel();
  }
}

function thawed(bytes: Uint8Array, epoch: number | undefined, turnId: string | undefined): Thawed {
  return {
    bytes,
    epoch,
    turnId,
    text: () => new TextDecoder().decode(bytes),
    json: <T>() => JSON.parse(new TextDecoder().decode(bytes)) as T,
  };
}

export interface SessionInit {
  key: string;
  epoch: number;
  turnId: string;
  resumeOf?: string | undefined;
  kind?: "turn" | "event";
  signal?: AbortSignal;
  memory?: Map<string, unknown>;
}

/**
 * One turn's view of its session: every write carries the turn's epoch, and a write the
 * fence refuses throws {@link Fenced}. After a stand-down every write throws `Fenced`
 * without a round trip.
 */
export class Session {
  readonly key: string;
  readonly epoch: number;
  /** `Leasehold-Turn-Id`. */
  readonly turnId: string;
  /** `Leasehold-Resume`: the id of the interrupted attempt this turn continues. */
  readonly resumeOf: string | undefined;
  /** Re-dispatched after its owner was lost mid-turn: see {@link Session.journalEvents}. */
  get resumed(): boolean {
    return this.resumeOf !== undefined;
  }
  readonly kind: "turn" | "event";
  /** Aborted on stand-down (reason: {@link Fenced}) or cancel (reason: {@link Interrupted}). */
  readonly signal: AbortSignal;
  /**
   * What the agent keeps in memory for this session between turns: kept while the
   * epoch stays the same, cleared on a new epoch, a stand-down, or a turn that threw.
   */
  readonly memory: Map<string, unknown>;
  readonly sidecar: SidecarApi;

  constructor(sidecar: SidecarApi, init: SessionInit) {
    this.sidecar = sidecar;
    this.key = checkKey(init.key);
    this.epoch = init.epoch;
    this.turnId = init.turnId;
    this.resumeOf = init.resumeOf;
    this.kind = init.kind ?? "turn";
    this.signal = init.signal ?? new AbortController().signal;
    this.memory = init.memory ?? new Map<string, unknown>();
  }

  /** Throws `Fenced` if the sidecar stood the session down (no write can land). */
  throwIfFenced(): void {
    if (this.signal.aborted && this.signal.reason instanceof Fenced) throw this.signal.reason;
  }

  /** Throws the abort reason (`Fenced` or `Interrupted`) if the turn must stop. */
  throwIfHalted(): void {
    if (this.signal.aborted) throw this.signal.reason;
  }

  /** The session's checkpoint, or `undefined` when it has none yet. */
  thaw(): Promise<Thawed | undefined> {
    this.throwIfHalted();
    return this.sidecar.getCheckpoint(this.key, this.signal);
  }

  /**
   * Write the checkpoint through the fence (`Fenced` when this node lost the session;
   * `Interrupted`, unsent, once the turn was cancelled).
   */
  async checkpoint(state: CheckpointState): Promise<void> {
    this.throwIfHalted();
    await this.sidecar.putCheckpoint(this.key, this.epoch, state);
  }

  /** Publish an event to the session's observers; its id. Unsent once the turn halted. */
  async publish(type: string, data?: unknown): Promise<string> {
    this.throwIfHalted();
    return this.sidecar.publish(this.key, this.epoch, type, data);
  }

  /**
   * The journaled events of this turn's earlier attempts (epochs below this one), oldest
   * first, to continue a resumed turn: publish only what they lack. `[]` when none.
   */
  journalEvents(turnId: string = this.resumeOf ?? this.turnId): Promise<JournalEvent[]> {
    this.throwIfHalted();
    return this.sidecar.journalEvents(this.key, turnId, this.epoch, this.signal);
  }

  /**
   * The session idled out: release its lease (claimable at once) and forget its memory.
   * Call it between turns (keep the `Session` of the last one), not inside a running
   * turn: the sidecar stands a released session down, so that turn would be halted.
   */
  async release(): Promise<void> {
    this.throwIfFenced();
    this.memory.clear();
    await this.sidecar.release(this.key, this.epoch);
  }
}

/** A turn or event as the agent receives it. */
export interface AgentRequest {
  kind: "turn" | "event";
  key: string;
  body: Uint8Array;
  contentType: string | undefined;
  /** Every header as received. */
  headers: Headers;
  /** Only the allow-listed client headers (`forwardHeaders`), e.g. `authorization`, `traceparent`. */
  clientHeaders: Headers;
  text(): string;
  /** The body as JSON; `{}` when empty; throws `AgentError(400, "malformed_json")`. */
  json<T = unknown>(): T;
}

/**
 * What a handler returns: a `Response` (status, headers and a possibly streamed body
 * as given), `undefined` (`204`), a string (`200 text/plain`), bytes (`200
 * application/octet-stream`) or anything else (`200` JSON).
 */
export type AgentAnswer = Response | string | Uint8Array | object | number | boolean | null | undefined;

export type TurnHandler = (session: Session, request: AgentRequest) => Promise<AgentAnswer> | AgentAnswer;

export interface AgentHandlerOptions {
  onTurn: TurnHandler;
  /** Events from elsewhere in the product; default: `onTurn` (see `request.kind`). */
  onEvent?: TurnHandler;
  /** The sidecar's agent API. Default `$LEASEHOLD_SIDECAR_URL`, else `http://127.0.0.1:8082`. */
  sidecarUrl?: string;
  /** Called after a stand-down halted the session's turns and dropped its memory. */
  onStandDown?: (key: string) => void | Promise<void>;
  /** Called when the sidecar cancelled a running turn (a newer one interrupted it), after `session.signal` aborted. */
  onCancel?: (key: string, turnId: string) => void | Promise<void>;
  /** The sidecar's `--forward-headers`, for `request.clientHeaders`. */
  forwardHeaders?: readonly string[];
  /** Largest turn body accepted (`413` above). Default 16 MiB. */
  maxBodyBytes?: number;
  /** Unexpected errors out of a handler (answered `500`). Default: `console.error`. */
  onError?: (error: unknown, session: Session) => void;
  fetch?: typeof fetch;
}

export type AgentHandler = ((req: IncomingMessage, res: ServerResponse) => void) & {
  readonly sidecar: SidecarApi;
  /** Halt a session's running turns and drop its memory (what a stand-down does). */
  standDown(key: string): void;
  /**
   * The session idled out: release its lease at the epoch this agent last served it
   * (`DELETE /v1/sessions/{key}/lease`) and drop its memory. `false` when this agent
   * holds nothing of it.
   */
  release(key: string): Promise<boolean>;
};

interface Running {
  turnId: string;
  controller: AbortController;
  /** Settles when the handler has settled. */
  settled: Promise<void>;
}

/** How long a cancel waits for the handler to settle before it answers anyway. */
const CANCEL_WAIT_MS = 3000; // under the sidecar's 5 s limit on the notification

async function settledWithin(promises: Promise<void>[], ms: number): Promise<void> {
  if (promises.length === 0) return;
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<void>((resolve) => {
    timer = setTimeout(resolve, ms);
  });
  await Promise.race([Promise.all(promises), timeout]);
  clearTimeout(timer);
}

/** One session's slot in the agent: its turns run one at a time. */
interface Slot {
  epoch: number | undefined;
  memory: Map<string, unknown>;
  running: Set<Running>;
  queued: number;
  tail: Promise<void>;
}

const TURN_ROUTE = /^\/sessions\/([^/]+)\/(turns|events|stand-down)$/;
const CANCEL_ROUTE = /^\/sessions\/([^/]+)\/turns\/([^/]+)\/cancel$/;

function json(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(text), ...headers });
  res.end(text);
}

function readBody(req: IncomingMessage, limit: number): Promise<Uint8Array | "too_large"> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    let over = false;
    req.on("data", (chunk: Buffer) => {
      size += chunk.length;
      if (size > limit) over = true;
      if (!over) chunks.push(chunk);
    });
    req.on("end", () => {
      resolve(over ? "too_large" : new Uint8Array(Buffer.concat(chunks)));
    });
    req.on("error", reject);
  });
}

function toHeaders(req: IncomingMessage): Headers {
  const headers = new Headers();
  for (const [name, value] of Object.entries(req.headers)) {
    if (value === undefined) continue;
    if (Array.isArray(value)) for (const v of value) headers.append(name, v);
    else headers.set(name, value);
  }
  return headers;
}

async function writeAnswer(res: ServerResponse, answer: AgentAnswer): Promise<void> {
  if (answer instanceof Response) {
    const headers: Record<string, string> = {};
    answer.headers.forEach((value, name) => {
      headers[name] = value;
    });
    res.writeHead(answer.status, headers);
    if (answer.body === null) {
      res.end();
      return;
    }
    await new Promise<void>((resolve, reject) => {
      const body = Readable.fromWeb(answer.body as Parameters<typeof Readable.fromWeb>[0]);
      body.on("error", reject);
      res.on("finish", resolve);
      res.on("close", resolve);
      body.pipe(res);
    });
    return;
  }
  if (answer === undefined) {
    res.writeHead(204);
    res.end();
    return;
  }
  if (typeof answer === "string") {
    res.writeHead(200, { "content-type": "text/plain; charset=utf-8", "content-length": Buffer.byteLength(answer) });
    res.end(answer);
    return;
  }
  if (answer instanceof Uint8Array) {
    res.writeHead(200, { "content-type": "application/octet-stream", "content-length": answer.byteLength });
    res.end(answer);
    return;
  }
  json(res, 200, answer);
}

/** The answer for an error out of a handler (or the reason its signal was aborted). */
function writeError(res: ServerResponse, error: unknown, session: Session, onError: (error: unknown, session: Session) => void): void {
  const reason: unknown = session.signal.aborted ? session.signal.reason : error;
  if (reason instanceof Fenced || error instanceof Fenced) {
    json(res, 409, { error: "fenced" });
  } else if (reason instanceof Interrupted) {
    json(res, 409, { error: "interrupted" });
  } else if (error instanceof SidecarRefused) {
    // e.g. 503 store_unavailable with its directive: the sidecar passes it to the client.
    const headers: Record<string, string> = { "content-type": "application/json" };
    const retryAfter = error.headers.get("retry-after");
    if (retryAfter !== null) headers["retry-after"] = retryAfter;
    res.writeHead(error.status, headers);
    res.end(error.body);
  } else if (error instanceof ConnectionError) {
    json(res, 502, { error: "sidecar_unreachable", message: error.message });
  } else if (error instanceof AgentError) {
    json(res, error.status, { error: error.code, message: error.message });
  } else {
    onError(error, session);
    json(res, 500, { error: "agent_error", message: error instanceof Error ? error.message : String(error) });
  }
}

/**
 * A `node:http` request handler serving docs/http-api.md, the agent contract for `onTurn` / `onEvent`:
 * `http.createServer(createAgentHandler({ onTurn })).listen(3000, "127.0.0.1")`.
 */
export function createAgentHandler(options: AgentHandlerOptions): AgentHandler {
  const sidecar = new SidecarApi(options.sidecarUrl, options.fetch);
  const forward = new Set((options.forwardHeaders ?? DEFAULT_FORWARD_HEADERS).map((h) => h.toLowerCase()));
  const maxBody = options.maxBodyBytes ?? 16 * 1024 * 1024;
  const onError =
    options.onError ??
    ((error: unknown, session: Session) => {
      console.error(`leasehold agent: turn ${session.turnId} of ${session.key} failed:`, error);
    });
  const slots = new Map<string, Slot>();

  const slotOf = (key: string): Slot => {
    let slot = slots.get(key);
    if (!slot) {
      slot = { epoch: undefined, memory: new Map(), running: new Set(), queued: 0, tail: Promise.resolve() };
      slots.set(key, slot);
    }
    return slot;
  };

  const forgetIfIdle = (key: string, slot: Slot): void => {
    if (slots.get(key) === slot && slot.queued === 0 && slot.running.size === 0 && slot.memory.size === 0) slots.delete(key);
  };

  const standDown = (key: string): void => {
    const slot = slots.get(key);
    if (!slot) return;
    slots.delete(key);
    slot.memory.clear();
    for (const turn of slot.running) turn.controller.abort(new Fenced("stand-down"));
  };

  const runTurn = async (req: IncomingMessage, res: ServerResponse, key: string, kind: "turn" | "event"): Promise<void> => {
    const epochHeader = req.headers["leasehold-epoch"];
    const epoch = typeof epochHeader === "string" && /^\d+$/.test(epochHeader) ? Number(epochHeader) : NaN;
    if (!Number.isSafeInteger(epoch) || epoch < 1) {
      req.resume();
      json(res, 400, { error: "missing_epoch", message: "Leasehold-Epoch header is required" });
      return;
    }
    const body = await readBody(req, maxBody);
    if (body === "too_large") {
      json(res, 413, { error: "too_large", message: `body exceeds ${maxBody} bytes` });
      return;
    }
    const headers = toHeaders(req);
    const clientHeaders = new Headers();
    headers.forEach((value, name) => {
      if (forward.has(name)) clientHeaders.set(name, value);
    });
    const request: AgentRequest = {
      kind,
      key,
      body,
      contentType: headers.get("content-type") ?? undefined,
      headers,
      clientHeaders,
      text: () => new TextDecoder().decode(body),
      json: <T>(): T => {
        const text = new TextDecoder().decode(body);
        if (text.trim() === "") return {} as T;
        try {
          return JSON.parse(text) as T;
        } catch (error) {
          throw new AgentError(400, "malformed_json", describe(error));
        }
      },
    };
    const turnId = headers.get("leasehold-turn-id") ?? crypto.randomUUID();
    const controller = new AbortController();
    let settle!: () => void;
    const settled = new Promise<void>((resolve) => {
      settle = resolve;
    });
    const running: Running = { turnId, controller, settled };
    // A client that went away does not stop the turn (docs/http-api.md, turn semantics); only the sidecar does.
    const slot = slotOf(key);
    slot.queued += 1;
    const previous = slot.tail;
    let done!: () => void;
    slot.tail = new Promise<void>((resolve) => {
      done = resolve;
    });
    await previous;
    slot.queued -= 1;
    // A stand-down while queued dropped the slot: this dispatch starts from a fresh one.
    const current = slots.get(key) === slot ? slot : slotOf(key);
    if (current.epoch !== epoch) {
      current.memory.clear();
      current.epoch = epoch;
    }
    current.running.add(running);
    const session = new Session(sidecar, {
      key,
      epoch,
      turnId,
      resumeOf: headers.get("leasehold-resume") ?? undefined,
      kind,
      signal: controller.signal,
      memory: current.memory,
    });
    const handler = kind === "event" ? (options.onEvent ?? options.onTurn) : options.onTurn;
    try {
      let answer: AgentAnswer;
      try {
        answer = await handler(session, request);
      } finally {
        settle();
      }
      if (controller.signal.aborted) throw controller.signal.reason;
      await writeAnswer(res, answer);
    } catch (error) {
      // What we hold may be stale (a cancelled turn kept nothing of it either): the next turn thaws again.
      current.memory.clear();
      if (!res.headersSent) writeError(res, error, session, onError);
      else res.destroy(error instanceof Error ? error : undefined);
    } finally {
      current.running.delete(running);
      done();
      forgetIfIdle(key, current);
    }
  };

  const handle = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    const path = (req.url ?? "/").split("?")[0] ?? "/";
    const cancel = CANCEL_ROUTE.exec(path);
    const route = TURN_ROUTE.exec(path);
    if (!cancel && !route) {
      req.resume();
      json(res, 404, { error: "not_found" });
      return;
    }
    if (req.method !== "POST") {
      req.resume();
      json(res, 405, { error: "method_not_allowed" }, { allow: "POST" });
      return;
    }
    let key: string;
    try {
      key = checkKey(decodeURIComponent((cancel ?? route)?.[1] ?? ""));
    } catch (error) {
      req.resume();
      json(res, 400, { error: "invalid_key", message: describe(error) });
      return;
    }
    if (cancel) {
      req.resume();
      const turnId = decodeURIComponent(cancel[2] ?? "");
      const stopped = [...(slots.get(key)?.running ?? [])].filter((turn) => turn.turnId === turnId);
      for (const turn of stopped) turn.controller.abort(new Interrupted());
      if (stopped.length > 0) {
        try {
          await options.onCancel?.(key, turnId);
        } catch (error) {
          console.error(`leasehold agent: onCancel(${key}, ${turnId}) failed:`, error);
        }
      }
      await settledWithin(
        stopped.map((turn) => turn.settled),
        CANCEL_WAIT_MS,
      );
      res.writeHead(204);
      res.end();
      return;
    }
    const action = route?.[2];
    if (action === "stand-down") {
      req.resume();
      standDown(key);
      try {
        await options.onStandDown?.(key);
      } catch (error) {
        console.error(`leasehold agent: onStandDown(${key}) failed:`, error);
      }
      res.writeHead(204);
      res.end();
      return;
    }
    await runTurn(req, res, key, action === "events" ? "event" : "turn");
  };

  const handler = (req: IncomingMessage, res: ServerResponse): void => {
    handle(req, res).catch((error: unknown) => {
      console.error("leasehold agent: request failed:", error);
      if (!res.headersSent) json(res, 500, { error: "agent_error", message: describe(error) });
      else res.destroy();
    });
  };
  const release = async (key: string): Promise<boolean> => {
    const slot = slots.get(checkKey(key));
    const epoch = slot?.epoch;
    if (!slot || epoch === undefined) return false;
    slot.memory.clear();
    forgetIfIdle(key, slot);
    await sidecar.release(key, epoch);
    return true;
  };
  return Object.assign(handler, { sidecar, standDown, release });
}
