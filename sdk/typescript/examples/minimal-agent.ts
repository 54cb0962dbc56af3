// The smallest complete leasehold agent (README.md shows it inline).
import { createServer } from "node:http";

import { createAgentHandler } from "@leasehold/sdk/agent";

interface State {
  history: string[];
}

const handler = createAgentHandler({
  sidecarUrl: process.env.LEASEHOLD_SIDECAR_URL ?? "http://127.0.0.1:8082",
  async onTurn(session, request) {
    const { text = "" } = request.json<{ text?: string }>();
    // The session's state as the last owner left it (any pod, any epoch).
    const state = (await session.thaw())?.json<State>() ?? { history: [] };
    await session.publish("turn_started", { text });
    state.history.push(text);
    // Fenced (this pod lost the session) throws `Fenced`: the SDK answers
    // 409 {"error":"fenced"} and the sidecar tells the client to retry elsewhere.
    await session.checkpoint(state);
    await session.publish("turn_finished", { history_len: state.history.length });
    return { history_len: state.history.length, epoch: session.epoch };
  },
});

const [host = "127.0.0.1", port = "3000"] = (process.env.DEMO_AGENT_LISTEN ?? "127.0.0.1:3000").split(":");
createServer(handler).listen(Number(port), host);
