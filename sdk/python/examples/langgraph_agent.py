#!/usr/bin/env python3
"""A LangGraph agent behind leasehold: a small StateGraph (no LLM) whose checkpoints live
in the session's fenced checkpoint, and whose steps stream to every observer.

Turn body: `{"text": "...", "think_ms": 0}`. The graph counts the session's turns and
echoes each text: `START -> count -> echo -> END`. Answer:
`{"count": n, "messages": [...], "epoch": e, "node": "<node-id>"}`.

A turn resumed after its pod died mid-graph (`session.resumed`) continues the graph from
the last step its earlier attempt checkpointed (each checkpoint's metadata names the turn
that wrote it) instead of running it again from the start.

    python examples/langgraph_agent.py --listen 127.0.0.1:3000 --sidecar-url http://127.0.0.1:8082
"""

from __future__ import annotations

import asyncio
import logging
import operator
import sys
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from starlette.applications import Starlette

from leasehold.agent import Session, TurnRequest, create_app
from leasehold.demo_agent import default_node_id, parse_args, split_listen
from leasehold.langgraph import LeaseholdSaver, astream_published


class State(TypedDict, total=False):
    messages: Annotated[list[str], operator.add]
    count: int
    think_ms: int


def count(state: State) -> dict[str, Any]:
    return {"count": state.get("count", 0) + 1}


async def echo(state: State) -> dict[str, Any]:
    await asyncio.sleep(state.get("think_ms", 0) / 1000)
    return {"messages": [f"echo:{state['messages'][-1]}"]}


def build_graph() -> StateGraph[State]:
    builder = StateGraph(State)
    builder.add_node("count", count)
    builder.add_node("echo", echo)
    builder.add_edge(START, "count")
    builder.add_edge("count", "echo")
    builder.add_edge("echo", END)
    return builder


def build_app(node_id: str, sidecar_url: str) -> Starlette:
    builder = build_graph()

    async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
        body = request.json() if request.body.strip() else {}
        if request.kind == "event":
            text = f"event:{body.get('name', 'event')}"
        else:
            text = str(body.get("text", ""))
        # One saver per turn: it carries this turn's epoch, so a zombie's step is fenced.
        saver = LeaseholdSaver.for_session(session)
        graph = builder.compile(checkpointer=saver)
        # Every checkpoint of this run names the turn (LangGraph copies run metadata).
        config: Any = {**saver.config, "metadata": {"turn_id": session.turn_id}}
        graph_input: dict[str, Any] | None = {
            "messages": [text],
            "think_ms": int(body.get("think_ms", 0)),
        }
        run = True
        if session.resumed:
            # Its earlier attempt may have run part of the graph: continue from its last
            # checkpoint (input `None`), or not at all if the graph had finished.
            last = await graph.aget_state(saver.config)
            if last.metadata and last.metadata.get("turn_id") == session.turn_id:
                graph_input, run = None, bool(last.next)
        if run:
            async for _chunk in astream_published(graph, graph_input, config, session=session):
                pass  # each step went to the observers as a `graph_updates` event
        values = (await graph.aget_state(saver.config)).values
        return {
            "count": values["count"],
            "messages": values["messages"],
            "epoch": session.epoch,
            "node": node_id,
        }

    return create_app(on_turn, sidecar_url=sidecar_url)


def main() -> None:
    import uvicorn

    args = parse_args()
    host, port = split_listen(args.listen)
    node_id = args.node_id or default_node_id()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    uvicorn.run(
        build_app(node_id, args.sidecar_url),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
