#!/usr/bin/env node
/**
 * A LangGraph agent on leasehold: a small StateGraph (no LLM) whose state lives in the
 * session's fenced checkpoint through `LeaseholdSaver`, and whose updates are streamed
 * to the session's observers through `publish`.
 *
 * The graph keeps the conversation (`messages`) and counts the turns. A turn's body is
 * `{"text": "..."}`; the answer is `{"reply", "turns", "messages", "epoch", "node"}`.
 * Whichever pod owns the session next continues from the same graph state. A turn
 * resumed after its pod died mid-graph (`session.resumed`) continues the graph from the
 * last step its earlier attempt checkpointed (each checkpoint's metadata names the turn)
 * instead of running it again.
 *
 *   node dist/examples/langgraph-agent.js --listen 127.0.0.1:3000 --sidecar-url http://127.0.0.1:8082
 */

import { createServer } from "node:http";
import { hostname } from "node:os";
import { parseArgs } from "node:util";

import { Annotation, END, START, StateGraph } from "@langchain/langgraph";

import { AgentError, createAgentHandler, type Session } from "@leasehold/sdk/agent";
import { LeaseholdSaver, publishGraphStream } from "@leasehold/sdk/langgraph";

const State = Annotation.Root({
  messages: Annotation<string[]>({ reducer: (a, b) => a.concat(b), default: () => [] }),
  turns: Annotation<number>({ reducer: (a, b) => a + b, default: () => 0 }),
  reply: Annotation<string>(),
});

/** receive → respond: appends the user's message, then the agent's reply. */
const builder = new StateGraph(State)
  .addNode("receive", (state: typeof State.State) => ({ turns: 1, messages: [`user: ${state.reply}`] }))
  .addNode("respond", (state: typeof State.State) => {
    const said = state.messages.at(-1)?.replace(/^user: /, "") ?? "";
    const reply = `you said "${said}" (turn ${state.turns})`;
    return { reply, messages: [`agent: ${reply}`] };
  })
  .addEdge(START, "receive")
  .addEdge("receive", "respond")
  .addEdge("respond", END);

const { values } = parseArgs({
  options: { listen: { type: "string" }, "sidecar-url": { type: "string" }, "node-id": { type: "string" } },
});
const listen = values.listen ?? process.env.DEMO_AGENT_LISTEN ?? "127.0.0.1:3000";
const sidecarUrl = values["sidecar-url"] ?? process.env.LEASEHOLD_SIDECAR_URL ?? "http://127.0.0.1:8082";
const nodeId = values["node-id"] ?? process.env.LEASEHOLD_NODE_ID ?? process.env.POD_NAME ?? process.env.HOSTNAME ?? (hostname() || "demo");

async function onTurn(session: Session, request: { json<T>(): T }): Promise<unknown> {
  const { text } = request.json<{ text?: unknown }>();
  if (typeof text !== "string") throw new AgentError(400, "malformed_json", 'expected {"text": "..."}');
  // One saver per turn: its writes carry this turn's epoch; a fenced one throws Fenced
  // out of the graph, and the SDK answers 409 {"error":"fenced"}.
  const graph = builder.compile({ checkpointer: LeaseholdSaver.forSession(session) });
  // Every checkpoint of this run names the turn (LangGraph copies the run's metadata).
  const config = { configurable: { thread_id: session.key }, signal: session.signal, metadata: { turn_id: session.turnId } };
  // The input goes in through `reply` (the receive node moves it into messages).
  let input: { reply: string } | null = { reply: text };
  let run = true;
  if (session.resumed) {
    // Its earlier attempt may have run part of the graph: continue from its last
    // checkpoint (input `null`), or not at all if the graph had finished.
    const last = await graph.getState(config);
    if ((last.metadata as Record<string, unknown> | undefined)?.turn_id === session.turnId) {
      input = null;
      run = last.next.length > 0;
    }
  }
  let updates = 0;
  if (run) {
    const stream = await graph.stream(input, { ...config, streamMode: "updates" as const });
    // Every node's update is published to the session's observers as it happens.
    for await (const _update of publishGraphStream(session, stream, { type: "graph_update" })) updates += 1;
  }
  const snapshot = await graph.getState(config);
  const final = snapshot.values as typeof State.State;
  return { reply: final.reply, turns: final.turns, messages: final.messages.length, updates, epoch: session.epoch, node: nodeId };
}

const agent = createAgentHandler({ onTurn, sidecarUrl });
const server = createServer(agent);
const at = listen.lastIndexOf(":");
server.on("error", (error) => {
  console.error(`langgraph-agent: --listen: cannot listen on ${listen}: ${error.message}`);
  process.exit(1);
});
server.listen(Number(listen.slice(at + 1)), listen.slice(0, at), () => {
  console.error(`langgraph agent ready: listen=${listen} sidecar=${sidecarUrl} node=${nodeId}`);
});
for (const signal of ["SIGTERM", "SIGINT"] as const) {
  process.on(signal, () => {
    server.close();
    process.exit(0);
  });
}
