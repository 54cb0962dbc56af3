// An agent whose turns survive the loss of their pod and can be interrupted.
//   node dist/examples/resumable-agent.js   (LEASEHOLD_SIDECAR_URL, DEMO_AGENT_LISTEN)
// A turn's body is {"text": "...", "steps": 5}: it publishes turn_started, one `step`
// event per step ({"i": n}: the index is what a resume counts), then turn_finished, and
// checkpoints {"history": [...], "lastTurn": "<turn id>"}.
import { createServer } from "node:http";
import { fileURLToPath } from "node:url";

import { createAgentHandler, type AgentRequest, type Session } from "@leasehold/sdk/agent";

interface State {
  history: string[];
  lastTurn?: string;
}

/** One unit of work (a model call, a tool call): pass it the turn's signal so it stops when the turn is cancelled. */
async function step(i: number, signal: AbortSignal): Promise<string> {
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(resolve, 50);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(signal.reason as Error);
    });
  });
  return `result ${String(i)}`;
}

export async function onTurn(session: Session, request: AgentRequest): Promise<object> {
  const { text = "", steps = 5 } = request.json<{ text?: string; steps?: number }>();
  let state = (await session.thaw())?.json<State>() ?? { history: [] };
  // A resumed turn: what its interrupted attempt published (watchers saw it already).
  const journal = session.resumed ? await session.journalEvents() : [];
  const done = new Set(journal.filter((e) => e.type === "step").map((e) => (e.data as { i: number }).i)).size;
  if (!session.resumed) await session.publish("turn_started", { text });
  for (let i = done; i < steps; i++) {
    // A cancel aborts session.signal (reason: Interrupted): `step` throws, and so would
    // any later publish or checkpoint, unsent. The SDK answers 409 interrupted.
    await session.publish("step", { i, result: await step(i, session.signal) });
  }
  if (state.lastTurn !== session.turnId) {
    // Not checkpointed by an earlier attempt of this turn: append it once.
    state = { history: [...state.history, text], lastTurn: session.turnId };
    await session.checkpoint(state); // Fenced if this pod lost the session
  }
  if (!journal.some((e) => e.type === "turn_finished")) {
    await session.publish("turn_finished", { history_len: state.history.length });
  }
  return { history_len: state.history.length, resumed: session.resumed };
}

export function onCancel(key: string, turnId: string): void {
  console.log(`${key}: turn ${turnId} was interrupted`);
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const handler = createAgentHandler({ onTurn, onCancel, sidecarUrl: process.env.LEASEHOLD_SIDECAR_URL ?? "http://127.0.0.1:8082" });
  const [host = "127.0.0.1", port = "3000"] = (process.env.DEMO_AGENT_LISTEN ?? "127.0.0.1:3000").split(":");
  createServer(handler).listen(Number(port), host);
}
