/**
 * Errors of the leasehold SDK. Every error the SDK throws on purpose is a
 * {@link LeaseholdError}: `code` is the server's error code (`"fenced"`, `"busy"`,
 * `"owner_failed"`, ...) or one of the SDK's own (`"retry_budget_exhausted"`,
 * `"unreachable"`, `"connection_failed"`, `"overflow"`, `"http_error"`), and `directive`
 * is the last retry directive the server sent on the way, when there was one.
 */

/** `{"delay_ms": D, "budget_ms": B}` of a `503` refusal (docs/http-api.md, the client API). */
export interface RetryDirective {
  /** The server's code: `takeover_pending`, `draining`, `store_unavailable`, ... */
  readonly error: string;
  readonly delayMs: number;
  readonly budgetMs: number;
  /** Where it came from: the JSON body, or only a `Retry-After` header. */
  readonly source: "body" | "retry-after";
}

export interface LeaseholdErrorOptions {
  directive?: RetryDirective | undefined;
  cause?: unknown;
}

export class LeaseholdError extends Error {
  readonly code: string;
  readonly directive: RetryDirective | undefined;

  constructor(code: string, message: string, options: LeaseholdErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = code;
    this.directive = options.directive;
  }
}

/**
 * The server kept refusing with directives and the last one's budget ran out
 * (`elapsed + delay_ms > budget_ms`). `directives` lists every code obeyed on the way.
 */
export class RetryBudgetExhausted extends LeaseholdError {
  readonly directives: readonly string[];
  readonly elapsedMs: number;

  constructor(directive: RetryDirective, directives: readonly string[], elapsedMs: number) {
    super(
      "retry_budget_exhausted",
      `gave up after ${elapsedMs} ms: last refusal ${directive.error} (budget ${directive.budgetMs} ms)`,
      { directive },
    );
    this.directives = directives;
    this.elapsedMs = elapsedMs;
  }
}

/**
 * `502 {"error":"owner_failed"}`: the turn was forwarded to its owner and failed after
 * it was sent, so it MAY have run. Never retried unless `retryOwnerFailed` is set.
 */
export class OwnerFailed extends LeaseholdError {
  readonly status: number;
  readonly body: string;

  constructor(body: string, options: LeaseholdErrorOptions = {}) {
    super("owner_failed", `owner failed: the turn may have run (${truncate(body)})`, options);
    this.status = 502;
    this.body = body;
  }
}

/**
 * This writer no longer owns the session (a `409 {"error":"fenced"}` from the sidecar,
 * or the sidecar stood the session down). Stop at once; nothing is retried.
 */
export class Fenced extends LeaseholdError {
  /** `"sidecar"`: a write was refused by the fence; `"stand-down"`: the sidecar told us. */
  readonly via: "sidecar" | "stand-down";

  constructor(via: "sidecar" | "stand-down", message?: string, options: LeaseholdErrorOptions = {}) {
    super("fenced", message ?? (via === "sidecar" ? "fenced: this node no longer owns the session" : "fenced: the sidecar stood the session down"), options);
    this.via = via;
  }
}

/** `422 {"error":"idempotency_key_reused"}`: the key was used before with another body. */
export class IdempotencyKeyReused extends LeaseholdError {
  readonly idempotencyKey: string;

  constructor(idempotencyKey: string) {
    super("idempotency_key_reused", `Idempotency-Key ${idempotencyKey} was used with another body`);
    this.idempotencyKey = idempotencyKey;
  }
}

/** `409 {"error":"busy","turn_id":…}` under the `reject` multitask policy. */
export class Busy extends LeaseholdError {
  /** The turn that is running. */
  readonly turnId: string | undefined;

  constructor(turnId: string | undefined) {
    super("busy", `session busy: turn ${turnId ?? "(unknown)"} is running`);
    this.turnId = turnId;
  }
}

/**
 * `409 {"error":"interrupted"}`: a newer turn interrupted this one (`interrupt` policy);
 * on the agent side, the reason of `session.signal` when the sidecar cancels the turn.
 */
export class Interrupted extends LeaseholdError {
  constructor(message = "interrupted by a newer turn") {
    super("interrupted", message);
  }
}

/** Any other answer that is not a success: status, headers and body as received. */
export class HttpError extends LeaseholdError {
  readonly status: number;
  readonly headers: Headers;
  readonly body: string;

  constructor(status: number, headers: Headers, body: string, options: LeaseholdErrorOptions & { code?: string } = {}) {
    const code = options.code ?? errorCode(body) ?? "http_error";
    super(code, `HTTP ${status}: ${truncate(body)}`, options);
    this.status = status;
    this.headers = headers;
    this.body = body;
  }

  /** The body parsed as JSON, or `undefined` when it is not JSON. */
  json(): unknown {
    try {
      return JSON.parse(this.body) as unknown;
    } catch {
      return undefined;
    }
  }
}

/**
 * The sidecar's agent API refused a write with something other than `fenced` (e.g.
 * `503 store_unavailable`). The agent handler passes it back to the sidecar as is.
 */
export class SidecarRefused extends HttpError {}

/**
 * No connection: `"unreachable"` when every node refused it (the request was never
 * sent anywhere), `"connection_failed"` when it broke in a way that may have reached a
 * server (never retried).
 */
export class ConnectionError extends LeaseholdError {
  constructor(code: "unreachable" | "connection_failed", message: string, cause: unknown) {
    super(code, message, { cause });
  }
}

/**
 * A stream reader fell behind the server's buffer and was cut (`event: overflow`).
 * Resume with `client.stream(key, { lastEventId })`; events the server no longer
 * buffers are gone.
 */
export class StreamOverflow extends LeaseholdError {
  readonly lastEventId: string | undefined;
  readonly missed: number | undefined;

  constructor(lastEventId: string | undefined, missed: number | undefined) {
    super("overflow", `stream overflow: ${missed ?? "some"} events missed after ${lastEventId ?? "the start"}`);
    this.lastEventId = lastEventId;
    this.missed = missed;
  }
}

function truncate(s: string, max = 300): string {
  return s.length > max ? `${s.slice(0, max)}…` : s;
}

/** The `"error"` field of a JSON error body. */
export function errorCode(body: string): string | undefined {
  try {
    const parsed = JSON.parse(body) as unknown;
    if (typeof parsed === "object" && parsed !== null && "error" in parsed) {
      const code: unknown = parsed.error;
      return typeof code === "string" ? code : undefined;
    }
  } catch {
    // not JSON
  }
  return undefined;
}
