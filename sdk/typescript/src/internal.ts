/** Helpers shared by the client and the agent side. Not part of the public API. */

import type { RetryDirective } from "./errors.js";

/** docs/http-api.md, the client API: 1–200 bytes of `[A-Za-z0-9._:@-]`. */
const KEY = /^[A-Za-z0-9._:@-]{1,200}$/;

export function checkKey(key: string): string {
  if (!KEY.test(key)) {
    throw new TypeError(`invalid session key ${JSON.stringify(key)}: 1-200 characters of [A-Za-z0-9._:@-]`);
  }
  return key;
}

export function trimBase(url: string): string {
  return url.replace(/\/+$/, "");
}

/**
 * Error codes of a failed connection attempt that never sent the request: the next node
 * may be tried without any risk of running a turn twice. (Node's `fetch` reports them as
 * the `cause` of a `TypeError("fetch failed")`; browsers give no detail, so there a
 * failed connection is surfaced, never retried.)
 */
const NOT_SENT = new Set([
  "ECONNREFUSED",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "EADDRNOTAVAIL",
  "ENOTFOUND",
  "EAI_AGAIN",
  "UND_ERR_CONNECT_TIMEOUT",
]);

function codesOf(error: unknown, depth = 0): string[] {
  if (depth > 5 || typeof error !== "object" || error === null) return [];
  const codes: string[] = [];
  const { code, cause, errors } = error as { code?: unknown; cause?: unknown; errors?: unknown };
  if (typeof code === "string") codes.push(code);
  codes.push(...codesOf(cause, depth + 1));
  if (Array.isArray(errors)) for (const e of errors) codes.push(...codesOf(e, depth + 1));
  return codes;
}

/** Whether a `fetch` rejection is a connection that was refused before anything was sent. */
export function neverSent(error: unknown): boolean {
  const codes = codesOf(error);
  return codes.length > 0 && codes.some((c) => NOT_SENT.has(c));
}

export function describe(error: unknown): string {
  if (error instanceof Error) {
    const codes = codesOf(error);
    return codes.length > 0 ? `${error.message} (${codes.join(", ")})` : error.message;
  }
  return String(error);
}

/** `Retry-After`: delta-seconds or an HTTP date; milliseconds from now. */
export function parseRetryAfter(value: string | null): number | undefined {
  if (value === null) return undefined;
  const trimmed = value.trim();
  if (/^\d+$/.test(trimmed)) return Number(trimmed) * 1000;
  const date = Date.parse(trimmed);
  return Number.isNaN(date) ? undefined : Math.max(0, date - Date.now());
}

/**
 * The retry directive of a `503`: the body's `{"error","retry":{"delay_ms","budget_ms"}}`
 * when present (millisecond precision), else a bare `Retry-After` header with
 * `retryAfterBudgetMs` as its budget. `undefined`: no directive, so no retry.
 */
export function parseDirective(body: string, headers: Headers, retryAfterBudgetMs: number): RetryDirective | undefined {
  try {
    const parsed = JSON.parse(body) as unknown;
    if (typeof parsed === "object" && parsed !== null) {
      const { error, retry } = parsed as { error?: unknown; retry?: unknown };
      if (typeof retry === "object" && retry !== null) {
        const { delay_ms: delay, budget_ms: budget } = retry as { delay_ms?: unknown; budget_ms?: unknown };
        if (typeof delay === "number" && typeof budget === "number" && delay >= 0 && budget >= 0) {
          return { error: typeof error === "string" ? error : "unavailable", delayMs: delay, budgetMs: budget, source: "body" };
        }
      }
    }
  } catch {
    // not JSON: maybe a proxy's 503 with Retry-After
  }
  const after = parseRetryAfter(headers.get("retry-after"));
  if (after === undefined) return undefined;
  let code = "unavailable";
  try {
    const parsed = JSON.parse(body) as { error?: unknown };
    if (typeof parsed.error === "string") code = parsed.error;
  } catch {
    // keep the generic code
  }
  return { error: code, delayMs: after, budgetMs: retryAfterBudgetMs, source: "retry-after" };
}

/** Wait `ms`, or reject with the signal's reason when it aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason as Error);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason as Error);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

export type Body = string | Uint8Array | ArrayBuffer | object | null | undefined;

/** A request body that can be sent again on a retry, with its default content type. */
export function encodeBody(body: Body, contentType?: string): { body: string | Uint8Array | undefined; contentType: string | undefined } {
  if (body === undefined || body === null) return { body: undefined, contentType };
  if (typeof body === "string") return { body, contentType: contentType ?? "text/plain; charset=utf-8" };
  if (body instanceof Uint8Array) return { body, contentType: contentType ?? "application/octet-stream" };
  if (body instanceof ArrayBuffer) return { body: new Uint8Array(body), contentType: contentType ?? "application/octet-stream" };
  return { body: JSON.stringify(body), contentType: contentType ?? "application/json" };
}

/**
 * A random UUID v4. `crypto.randomUUID` exists in Node and in browsers' secure contexts;
 * elsewhere (a page over plain http) it is built from `crypto.getRandomValues`.
 */
export function randomUuid(): string {
  if (typeof crypto.randomUUID === "function") return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = ((b[6] ?? 0) & 0x0f) | 0x40;
  b[8] = ((b[8] ?? 0) & 0x3f) | 0x80;
  const hex = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

export function isUuid(s: string): boolean {
  return /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i.test(s);
}

/** `<epoch>-<seq>` of an event id, or `undefined`. */
export function parseEventId(id: string): { epoch: number; seq: number } | undefined {
  const m = /^(\d+)-(\d+)$/.exec(id);
  if (!m?.[1] || !m[2]) return undefined;
  return { epoch: Number(m[1]), seq: Number(m[2]) };
}

export function compareEventIds(a: { epoch: number; seq: number }, b: { epoch: number; seq: number }): number {
  return a.epoch !== b.epoch ? a.epoch - b.epoch : a.seq - b.seq;
}

export function parseJsonOrText(text: string): unknown {
  try {
    return JSON.parse(text) as unknown;
  } catch {
    return text;
  }
}
