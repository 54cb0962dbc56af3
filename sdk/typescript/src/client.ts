/**
 * The client of leasehold's public API (docs/http-api.md, the client API): turns and events that honour
 * retry directives, event streams that follow a session across pods, session and turn
 * reads. Uses only the global `fetch`, so it runs in Node ≥ 20 and in browsers.
 */

import {
  Busy,
  ConnectionError,
  Fenced,
  HttpError,
  IdempotencyKeyReused,
  Interrupted,
  OwnerFailed,
  RetryBudgetExhausted,
  StreamOverflow,
  errorCode,
  type RetryDirective,
} from "./errors.js";
import {
  type Body,
  checkKey,
  compareEventIds,
  describe,
  encodeBody,
  isUuid,
  neverSent,
  parseDirective,
  parseEventId,
  parseJsonOrText,
  randomUuid,
  sleep,
  trimBase,
} from "./internal.js";
import { SseParser } from "./sse.js";

export type Multitask = "enqueue" | "reject" | "interrupt";

export interface RetryPolicy {
  /** Wait this long before re-sending. */
  delayMs: number;
  /** Give up (with the error) once this much time has passed since the first attempt. */
  budgetMs: number;
  /** Re-send at most this many times. Default 3. */
  maxRetries?: number;
}

export interface ClientOptions {
  /** One or more node URLs (`http://leasehold.example:8080`); used round robin. */
  baseUrls: string | readonly string[];
  /** Headers sent with every request (e.g. `authorization`). */
  headers?: Record<string, string>;
  /**
   * Re-send a turn or event that may have run — answered `502 owner_failed`, or its
   * connection lost after it was sent (reset, closed before the answer) — with the same
   * `Idempotency-Key`: the server runs a key once and answers a repeat with the recorded
   * answer (`replayed`) or attaches it to the attempt still running (docs/http-api.md,
   * turn semantics). Default `true`, meaning `{ delayMs: 200, budgetMs: 30000,
   * maxRetries: 3 }`; then the failure is thrown (`OwnerFailed`, `ConnectionError`).
   * Set `false` against a sidecar that does not record idempotency keys (before the
   * turn journal): there a re-sent turn may run twice.
   */
  retryOwnerFailed?: boolean | RetryPolicy;
  /** Budget for a `503` that carries only `Retry-After` (no JSON directive). Default 30 s. */
  retryAfterBudgetMs?: number;
  /** `fetch` to use (default: the global one). */
  fetch?: typeof fetch;
}

export interface TurnOptions {
  /** Default: `application/json` for objects, `text/plain; charset=utf-8` for strings. */
  contentType?: string;
  /** Default: a fresh `crypto.randomUUID()`, reused by every re-send of this turn. */
  idempotencyKey?: string;
  /** `Leasehold-Multitask`: what to do if another turn of the session is running. */
  multitask?: Multitask;
  signal?: AbortSignal;
  /** Extra request headers (e.g. `traceparent`); the sidecar forwards its allow-list. */
  headers?: Record<string, string>;
}

/** A turn's successful answer (any 2xx). The agent's body is not read yet. */
export interface TurnResult {
  status: number;
  /** `Leasehold-Owner`: the node that ran it. */
  owner: string | undefined;
  /** `Leasehold-Epoch`. */
  epoch: number | undefined;
  /** `Leasehold-Replayed: true`: a recorded answer of an earlier attempt with this key. */
  replayed: boolean;
  idempotencyKey: string;
  /** Directive codes obeyed on the way, in order. */
  directives: string[];
  /** The node that gave this answer. */
  baseUrl: string;
  headers: Headers;
  /** The raw response: its body may be streamed (`response.body`). */
  response: Response;
  json<T = unknown>(): Promise<T>;
  text(): Promise<string>;
  bytes(): Promise<Uint8Array>;
}

export interface SessionInfo {
  key: string;
  /** Node id of the live owner, or `null`. */
  owner: string | null;
  epoch: number | null;
  expiresInMs: number | null;
  claimable: boolean;
}

export type TurnState = "running" | "finished" | "interrupted" | "cancelled";

/** A finished turn's recorded answer: what its client got (or would have got). */
export interface TurnAnswer {
  status: number;
  contentType: string | undefined;
  /** As the server reports it (the answer's body). */
  body: unknown;
}

export interface TurnInfo {
  turnId: string;
  state: TurnState;
  /** The epoch of the turn's latest attempt. */
  epoch: number | undefined;
  /** How many attempts it took (more than 1 after a resume). */
  attempts: number | undefined;
  /** The recorded answer, once finished. */
  answer: TurnAnswer | undefined;
  /** The whole JSON body. */
  raw: Record<string, unknown>;
}

function turnAnswer(value: unknown): TurnAnswer | undefined {
  if (typeof value !== "object" || value === null) return undefined;
  const { status, content_type: contentType, body } = value as Record<string, unknown>;
  return { status: typeof status === "number" ? status : 0, contentType: typeof contentType === "string" ? contentType : undefined, body };
}

/** One event of a session's stream. */
export interface LeaseholdEvent {
  /** `<epoch>-<seq>`: what `Last-Event-ID` takes. */
  id: string;
  epoch: number;
  seq: number;
  type: string;
  /** `data` parsed as JSON (the raw text when it is not JSON). */
  data: unknown;
  rawData: string;
}

export interface ReconnectInfo {
  /** `reconnect`: the node drained; `dropped`: the connection broke or ended; `overflow`: see `resumeOnOverflow`. */
  reason: "reconnect" | "dropped" | "overflow";
  lastEventId: string | undefined;
  /** The node tried next. */
  baseUrl: string;
}

export interface StreamOptions {
  /** Resume after this id (`Last-Event-ID`). */
  lastEventId?: string;
  signal?: AbortSignal;
  /**
   * On `event: overflow` (this reader fell behind and the server cut it): `false`
   * (default) throws {@link StreamOverflow}; `true` reconnects with `Last-Event-ID`
   * and carries on with whatever the server still buffers, so a gap is possible.
   */
  resumeOnOverflow?: boolean;
  /** Give up after failing to (re)connect for this long. Default 30 s. */
  reconnectBudgetMs?: number;
  /** Called before every reconnect. */
  onReconnect?: (info: ReconnectInfo) => void;
  /** Control frames without an id (`idle`, `reconnect`, `overflow`, ...). */
  onControl?: (type: string, data: unknown) => void;
}

interface Exchange {
  response: Response;
  directives: string[];
  lastDirective: RetryDirective | undefined;
  baseUrl: string;
}

interface ExchangeOptions {
  method: string;
  path: string;
  body?: string | Uint8Array | undefined;
  headers: Record<string, string>;
  signal?: AbortSignal | undefined;
  ownerFailed?: RetryPolicy | undefined;
}

const OWNER_FAILED_DEFAULT: RetryPolicy = { delayMs: 200, budgetMs: 30_000, maxRetries: 3 };

/** Failures after the request was sent that are a slow answer, not a lost one: never re-sent. */
const TIMEOUTS = new Set(["UND_ERR_HEADERS_TIMEOUT", "UND_ERR_BODY_TIMEOUT", "ETIMEDOUT"]);

function isTimeout(error: unknown): boolean {
  for (let e: unknown = error, depth = 0; e instanceof Error && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && TIMEOUTS.has(code)) return true;
    if (e.name === "TimeoutError") return true;
  }
  return false;
}

function turnPath(key: string, turnId: string): string {
  if (!/^[\x21-\x7e]{1,255}$/.test(turnId)) throw new TypeError("a turn id is 1-255 visible ASCII characters");
  return `/v1/sessions/${encodeURIComponent(checkKey(key))}/turns/${encodeURIComponent(turnId)}`;
}

export class Client {
  readonly baseUrls: readonly string[];
  private readonly headers: Record<string, string>;
  private readonly ownerFailed: RetryPolicy | undefined;
  private readonly retryAfterBudgetMs: number;
  private readonly fetch: typeof fetch;
  private counter = 0;

  constructor(options: ClientOptions | string | readonly string[]) {
    const opts: ClientOptions = typeof options === "string" || Array.isArray(options) ? { baseUrls: options as string | string[] } : (options as ClientOptions);
    const urls = typeof opts.baseUrls === "string" ? [opts.baseUrls] : [...opts.baseUrls];
    if (urls.length === 0) throw new TypeError("a Client needs at least one base URL");
    this.baseUrls = urls.map(trimBase);
    this.headers = { ...(opts.headers ?? {}) };
    const retry = opts.retryOwnerFailed ?? true;
    this.ownerFailed = retry === true ? OWNER_FAILED_DEFAULT : retry || undefined;
    if (this.ownerFailed !== undefined && (this.ownerFailed.maxRetries ?? 3) < 0) throw new TypeError("maxRetries must be >= 0");
    this.retryAfterBudgetMs = opts.retryAfterBudgetMs ?? 30_000;
    this.fetch = opts.fetch ?? ((input, init) => globalThis.fetch(input, init));
  }

  /** Send a message from the session's user: `POST /v1/sessions/{key}/turns`. */
  sendTurn(key: string, body: Body, options: TurnOptions = {}): Promise<TurnResult> {
    return this.post("turns", key, body, options);
  }

  /** Send an event from elsewhere in the product: `POST /v1/sessions/{key}/events`. */
  sendEvent(key: string, body: Body, options: TurnOptions = {}): Promise<TurnResult> {
    return this.post("events", key, body, options);
  }

  /** `GET /v1/sessions/{key}`: who owns it; a read, never a claim. */
  async session(key: string, options: { signal?: AbortSignal } = {}): Promise<SessionInfo> {
    const ex = await this.exchange({ method: "GET", path: `/v1/sessions/${encodeURIComponent(checkKey(key))}`, headers: {}, signal: options.signal });
    if (!ex.response.ok) throw await this.failure(ex, undefined);
    const raw = (await ex.response.json()) as Record<string, unknown>;
    return {
      key: String(raw.key),
      owner: typeof raw.owner === "string" ? raw.owner : null,
      epoch: typeof raw.epoch === "number" ? raw.epoch : null,
      expiresInMs: typeof raw.expires_in_ms === "number" ? raw.expires_in_ms : null,
      claimable: raw.claimable === true,
    };
  }

  /**
   * `GET /v1/sessions/{key}/turns/{id}` (docs/http-api.md, turn semantics): the turn's state
   * and, once finished, its recorded answer; `undefined` on `404`. The id is the turn's
   * `Idempotency-Key` (`result.idempotencyKey`).
   */
  getTurn(key: string, turnId: string, options: { signal?: AbortSignal } = {}): Promise<TurnInfo | undefined> {
    return this.turn(key, turnId, options);
  }

  /** The same as {@link Client.getTurn}. */
  async turn(key: string, turnId: string, options: { signal?: AbortSignal } = {}): Promise<TurnInfo | undefined> {
    const path = turnPath(key, turnId);
    const ex = await this.exchange({ method: "GET", path, headers: {}, signal: options.signal });
    if (ex.response.status === 404) {
      await ex.response.body?.cancel();
      return undefined;
    }
    if (!ex.response.ok) throw await this.failure(ex, undefined);
    const raw = (await ex.response.json()) as Record<string, unknown>;
    return {
      turnId: typeof raw.turn_id === "string" ? raw.turn_id : turnId,
      state: raw.state as TurnState,
      epoch: typeof raw.epoch === "number" ? raw.epoch : undefined,
      attempts: typeof raw.attempts === "number" ? raw.attempts : undefined,
      answer: turnAnswer(raw.answer),
      raw,
    };
  }

  /**
   * `DELETE /v1/sessions/{key}/turns/{id}`: cancel a turn, queued or running (docs/http-api.md,
   * turn semantics). `true` when the server accepted it, `false` on `404` (no such turn).
   */
  async cancelTurn(key: string, turnId: string, options: { signal?: AbortSignal } = {}): Promise<boolean> {
    const ex = await this.exchange({ method: "DELETE", path: turnPath(key, turnId), headers: {}, signal: options.signal });
    if (ex.response.status === 404) {
      await ex.response.body?.cancel();
      return false;
    }
    if (!ex.response.ok) throw await this.failure(ex, undefined);
    await ex.response.body?.cancel();
    return true;
  }

  /**
   * `GET /v1/sessions/{key}/stream` as an async iterable of events. Any node serves it.
   * On `event: reconnect` (a drain) or a dropped connection it reconnects to the next
   * node with `Last-Event-ID`, so no event is delivered twice and none of a lower epoch
   * than one already delivered. Break out of the loop (or abort `signal`) to stop.
   */
  stream(key: string, options: StreamOptions = {}): AsyncIterable<LeaseholdEvent> {
    checkKey(key);
    return { [Symbol.asyncIterator]: () => this.streamEvents(key, options) };
  }

  private nextBase(): number {
    const i = this.counter % this.baseUrls.length;
    this.counter = (this.counter + 1) % Number.MAX_SAFE_INTEGER;
    return i;
  }

  private async post(kind: "turns" | "events", key: string, body: Body, options: TurnOptions): Promise<TurnResult> {
    const idempotencyKey = options.idempotencyKey ?? randomUuid();
    if (!/^[\x21-\x7e]{1,255}$/.test(idempotencyKey)) {
      throw new TypeError("Idempotency-Key must be 1-255 visible ASCII characters");
    }
    const encoded = encodeBody(body, options.contentType);
    const headers: Record<string, string> = { ...(options.headers ?? {}), "idempotency-key": idempotencyKey };
    // Servers that predate Idempotency-Key still take a UUID turn id from the client:
    // every re-send then reaches the agent with the same Leasehold-Turn-Id.
    if (isUuid(idempotencyKey)) headers["leasehold-turn-id"] = idempotencyKey;
    if (encoded.contentType !== undefined) headers["content-type"] = encoded.contentType;
    if (options.multitask !== undefined) headers["leasehold-multitask"] = options.multitask;
    const ex = await this.exchange({
      method: "POST",
      path: `/v1/sessions/${encodeURIComponent(checkKey(key))}/${kind}`,
      body: encoded.body,
      headers,
      signal: options.signal,
      ownerFailed: this.ownerFailed,
    });
    const { response } = ex;
    if (!response.ok) throw await this.failure(ex, idempotencyKey);
    const epoch = response.headers.get("leasehold-epoch");
    return {
      status: response.status,
      owner: response.headers.get("leasehold-owner") ?? undefined,
      epoch: epoch === null ? undefined : Number(epoch),
      replayed: response.headers.get("leasehold-replayed") === "true",
      idempotencyKey,
      directives: ex.directives,
      baseUrl: ex.baseUrl,
      headers: response.headers,
      response,
      json: <T>() => response.json() as Promise<T>,
      text: () => response.text(),
      bytes: async () => new Uint8Array(await response.arrayBuffer()),
    };
  }

  /** The typed error for a non-2xx answer (its body is read). */
  private async failure(ex: Exchange, idempotencyKey: string | undefined): Promise<Error> {
    const { response } = ex;
    const text = await response.text();
    const code = errorCode(text);
    const directive = ex.lastDirective;
    if (response.status === 409 && code === "fenced") return new Fenced("sidecar", undefined, { directive });
    if (response.status === 409 && code === "busy") {
      const turnId = (parseJsonOrText(text) as { turn_id?: unknown }).turn_id;
      return new Busy(typeof turnId === "string" ? turnId : undefined);
    }
    if (response.status === 409 && code === "interrupted") return new Interrupted();
    if (response.status === 422 && code === "idempotency_key_reused" && idempotencyKey !== undefined) {
      return new IdempotencyKeyReused(idempotencyKey);
    }
    if (response.status === 502 && code === "owner_failed") return new OwnerFailed(text, { directive });
    return new HttpError(response.status, response.headers, text, { directive });
  }

  /**
   * One request, re-sent only as directed: after a `503` directive's delay (until its
   * budget), to the next node when a connection is refused before anything was sent,
   * and, under `ownerFailed` (turns and events), after `502 owner_failed` or a
   * connection lost after sending, with the same key, `maxRetries` times at most.
   */
  private async exchange(opts: ExchangeOptions): Promise<Exchange> {
    const started = Date.now();
    const directives: string[] = [];
    let lastDirective: RetryDirective | undefined;
    let node = this.nextBase();
    let refused = 0;
    let resent = 0;
    /** The delay before re-sending a request that may have run, or `undefined`. */
    const resend = (code: string): number | undefined => {
      const policy = opts.ownerFailed;
      if (policy === undefined || resent >= (policy.maxRetries ?? 3)) return undefined;
      if (Date.now() - started + policy.delayMs > policy.budgetMs) return undefined;
      resent += 1;
      directives.push(code);
      return policy.delayMs;
    };
    for (;;) {
      opts.signal?.throwIfAborted();
      const baseUrl = this.baseUrls[node] as string;
      let response: Response;
      try {
        response = await this.fetch(`${baseUrl}${opts.path}`, {
          method: opts.method,
          headers: { ...this.headers, ...opts.headers },
          body: opts.body ?? null,
          signal: opts.signal ?? null,
          redirect: "manual",
        });
      } catch (error) {
        if (opts.signal?.aborted) throw error;
        if (neverSent(error)) {
          if (refused + 1 < this.baseUrls.length) {
            refused += 1;
            node = (node + 1) % this.baseUrls.length;
            continue;
          }
          throw new ConnectionError("unreachable", `no node accepted the connection: ${describe(error)}`, error);
        }
        const delay = isTimeout(error) ? undefined : resend("connection_lost");
        if (delay === undefined) {
          throw new ConnectionError("connection_failed", `request to ${baseUrl} failed: ${describe(error)}`, error);
        }
        await sleep(delay, opts.signal);
        node = this.nextBase();
        continue;
      }
      refused = 0;
      let directive: RetryDirective | undefined;
      if (response.status === 503) {
        const text = await response.text();
        directive = parseDirective(text, response.headers, this.retryAfterBudgetMs);
        if (directive === undefined) {
          response = new Response(text, { status: response.status, statusText: response.statusText, headers: response.headers });
        }
      } else if (response.status === 502 && opts.ownerFailed !== undefined) {
        const text = await response.text();
        const delay = errorCode(text) === "owner_failed" ? resend("owner_failed") : undefined;
        if (delay !== undefined) {
          await sleep(delay, opts.signal);
          node = this.nextBase();
          continue;
        }
        response = new Response(text, { status: response.status, statusText: response.statusText, headers: response.headers });
      }
      if (directive === undefined) return { response, directives, lastDirective, baseUrl };
      directives.push(directive.error);
      lastDirective = directive;
      const elapsed = Date.now() - started;
      if (elapsed + directive.delayMs > directive.budgetMs) {
        throw new RetryBudgetExhausted(directive, directives, elapsed);
      }
      await sleep(directive.delayMs, opts.signal);
      node = this.nextBase();
    }
  }

  private async *streamEvents(key: string, options: StreamOptions): AsyncGenerator<LeaseholdEvent, void, undefined> {
    const path = `/v1/sessions/${encodeURIComponent(key)}/stream`;
    const budget = options.reconnectBudgetMs ?? 30_000;
    const { signal } = options;
    let lastId = options.lastEventId;
    let last = lastId === undefined ? undefined : parseEventId(lastId);
    let retryMs = 250;
    let backoff = 0;
    let failingSince: number | undefined;
    let reason: ReconnectInfo["reason"] | undefined;
    let node = this.nextBase();

    const failed = async (error: unknown): Promise<void> => {
      const now = Date.now();
      failingSince ??= now;
      if (now - failingSince > budget) {
        throw new ConnectionError("unreachable", `stream of ${key}: no node served it for ${budget} ms: ${describe(error)}`, error);
      }
      backoff = backoff === 0 ? Math.min(100, retryMs) : Math.min(backoff * 2, Math.max(retryMs, 2000));
      await sleep(backoff, signal);
      node = (node + 1) % this.baseUrls.length;
    };

    for (;;) {
      signal?.throwIfAborted();
      const baseUrl = this.baseUrls[node] as string;
      if (reason !== undefined) options.onReconnect?.({ reason, lastEventId: lastId, baseUrl });
      const headers: Record<string, string> = { ...this.headers, accept: "text/event-stream" };
      if (lastId !== undefined) headers["last-event-id"] = lastId;
      const controller = new AbortController();
      const onAbort = (): void => {
        controller.abort(signal?.reason);
      };
      signal?.addEventListener("abort", onAbort, { once: true });
      try {
        let response: Response;
        try {
          response = await this.fetch(`${baseUrl}${path}`, { headers, signal: controller.signal });
        } catch (error) {
          if (signal?.aborted) throw error;
          reason = "dropped";
          await failed(error);
          continue;
        }
        if (response.status === 503) {
          const text = await response.text();
          const directive = parseDirective(text, response.headers, this.retryAfterBudgetMs);
          if (directive === undefined) throw new HttpError(503, response.headers, text);
          failingSince ??= Date.now();
          if (Date.now() - failingSince + directive.delayMs > directive.budgetMs) {
            throw new RetryBudgetExhausted(directive, [directive.error], Date.now() - failingSince);
          }
          await sleep(directive.delayMs, signal);
          node = this.nextBase();
          reason = "dropped";
          continue;
        }
        if (!response.ok || response.body === null) {
          throw new HttpError(response.status, response.headers, await response.text());
        }
        failingSince = undefined;
        backoff = 0;
        const parser = new SseParser();
        const reader = response.body.getReader();
        let ended: ReconnectInfo["reason"] = "dropped";
        try {
          read: for (;;) {
            let chunk: Awaited<ReturnType<typeof reader.read>>;
            try {
              chunk = await reader.read();
            } catch (error) {
              if (signal?.aborted) throw error;
              break; // the connection broke: reconnect
            }
            if (chunk.done) break;
            for (const frame of parser.push(chunk.value as Uint8Array)) {
              if (frame.retry !== undefined) retryMs = frame.retry;
              if (frame.id === undefined) {
                const data = parseJsonOrText(frame.data);
                options.onControl?.(frame.event, data);
                if (frame.event === "reconnect") {
                  ended = "reconnect";
                  break read;
                }
                if (frame.event === "overflow") {
                  const info = typeof data === "object" && data !== null ? (data as { missed?: unknown }) : {};
                  if (!options.resumeOnOverflow) {
                    throw new StreamOverflow(lastId, typeof info.missed === "number" ? info.missed : undefined);
                  }
                  ended = "overflow";
                  break read;
                }
                continue;
              }
              const parsed = parseEventId(frame.id);
              if (parsed !== undefined && last !== undefined && compareEventIds(parsed, last) <= 0) continue;
              if (parsed !== undefined) last = parsed;
              lastId = frame.id;
              yield {
                id: frame.id,
                epoch: parsed?.epoch ?? 0,
                seq: parsed?.seq ?? 0,
                type: frame.event,
                data: parseJsonOrText(frame.data),
                rawData: frame.data,
              };
            }
          }
        } finally {
          controller.abort();
          reader.cancel().catch(() => undefined);
        }
        reason = ended;
        node = (node + 1) % this.baseUrls.length;
        if (ended === "dropped") {
          // Not a directive: a read of a stream is safe to repeat. Spread the reconnects.
          failingSince ??= Date.now();
          await sleep(Math.min(retryMs, 1000), signal);
        }
      } finally {
        signal?.removeEventListener("abort", onAbort);
      }
    }
  }
}
