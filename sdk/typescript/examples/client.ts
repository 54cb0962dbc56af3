#!/usr/bin/env node
/**
 * Send turns to a session while watching its events, with `@leasehold/sdk`'s `Client`.
 *
 *   node dist/examples/client.js http://127.0.0.1:8080,http://127.0.0.2:8080 chat-7 hello "and again"
 *
 * The base URLs are every node's public URL (or one load balancer's).
 */

import { setTimeout as sleep } from "node:timers/promises";

import { Client, ConnectionError, HttpError, OwnerFailed, RetryBudgetExhausted, StreamOverflow } from "@leasehold/sdk";

const [urls = "http://127.0.0.1:8080", key = "chat-7", ...rest] = process.argv.slice(2);
const texts = rest.length > 0 ? rest : ["hello"];
const client = new Client({ baseUrls: urls.split(",") });
const stop = new AbortController();

/** Print the session's events as they come, from whichever node serves the stream. */
async function watch(lastEventId?: string): Promise<void> {
  try {
    const events = client.stream(key, {
      lastEventId,
      signal: stop.signal,
      onControl: (type) => {
        if (type === "idle") console.log("  (no owner right now)");
      },
    });
    for await (const event of events) {
      console.log(`  event ${event.id} ${event.type} ${JSON.stringify(event.data)}`);
      lastEventId = event.id;
    }
  } catch (error) {
    if (stop.signal.aborted) return;
    // We fell behind the server's buffer: carry on from the last event we saw,
    // knowing that events the server no longer buffers are gone.
    if (error instanceof StreamOverflow) return watch(error.lastEventId);
    throw error;
  }
}

async function send(text: string): Promise<void> {
  try {
    const answer = await client.sendTurn(key, { text });
    let retried = answer.directives.length > 0 ? ` after ${answer.directives.join(", ")}` : "";
    if (answer.replayed) retried += " (a replay of its recorded answer)";
    console.log(`${text}: ran on ${answer.owner ?? "?"} at epoch ${answer.epoch ?? "?"}${retried}: ${await answer.text()}`);
  } catch (error) {
    if (error instanceof RetryBudgetExhausted) {
      // Refused with directives until their budget ran out: the turn did not run.
      console.log(`${text}: not run, gave up after ${error.directives.join(", ")}`);
    } else if (error instanceof OwnerFailed) {
      // The turn may have run. The client re-sent it with the same Idempotency-Key (the
      // server runs a key once) 3 times at most, then gave up.
      console.log(`${text}: may have run (owner_failed)`);
    } else if (error instanceof ConnectionError) {
      console.log(`${text}: ${error.code}: ${error.message}`);
    } else if (error instanceof HttpError) {
      // Any other non-2xx answer, e.g. the agent's own 400.
      console.log(`${text}: HTTP ${error.status} ${error.code}`);
    } else {
      throw error;
    }
  }
}

const watching = watch();
for (const text of texts) await send(text);
await sleep(500); // let the last events arrive
stop.abort();
await watching;
const info = await client.session(key); // a read: never claims the session
console.log(`${key}: owner ${info.owner ?? "none"}, epoch ${info.epoch ?? "none"}`);
