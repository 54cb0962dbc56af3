"""The reference agent in Python: the same behaviour as the Rust `leasehold-demo-agent`
(docs/http-api.md), written with `leasehold.agent`.

A turn's body is JSON `{"text": "...", "think_ms": 0, "tokens": 5}` (all optional; an
event's `{"name": "..."}` is recorded as `event:<name>`). For each turn it thaws its
state (`{"history": [...]}`) unless it already holds it at this epoch; publishes
`turn_started`, then `tokens` events of type `token` spread over `think_ms`, then
`turn_finished`; appends to `history`; checkpoints; answers
`200 {"history_len": n, "epoch": e, "node": "<node-id>"}`. A fenced write stops it at
once (`409 {"error":"fenced"}`); a stand-down drops what it holds. A resumed turn
(`Leasehold-Resume`) publishes no second `turn_started` and only the tokens its earlier
attempts did not journal (`turn_finished` unless journaled), and does not append its
entry twice (the checkpoint's `last_turn`); a cancelled one stops at once
(`409 {"error":"interrupted"}`, answered by the SDK).

    python -m leasehold.demo_agent --listen 127.0.0.1:3000 --sidecar-url http://127.0.0.1:8082
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .agent import DEFAULT_SIDECAR_URL, Session, SidecarApi, TurnRequest, create_app
from .errors import LeaseholdError

#: Tokens published when the body does not say.
DEFAULT_TOKENS = 5
#: Upper bound on `think_ms`, so one request cannot park a task for hours.
MAX_THINK_MS = 600_000


class BadInput(ValueError):
    """The body is not the demo's JSON."""


class BadCheckpoint(ValueError):
    """The stored checkpoint is not `{"history": [...]}`: the turn stops rather than
    start over (which would overwrite the history with one entry)."""


@dataclass(frozen=True)
class Input:
    text: str | None = None
    name: str | None = None
    think_ms: int = 0
    tokens: int | None = None

    @classmethod
    def parse(cls, body: bytes) -> Input:
        if not body.strip():
            return cls()
        try:
            value = json.loads(body)
        except ValueError as e:
            raise BadInput(str(e)) from e
        if not isinstance(value, dict):
            raise BadInput("expected a JSON object")

        def optional(name: str, kind: type) -> Any:
            v = value.get(name)
            if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
                raise BadInput(f"{name}: expected {kind.__name__}")
            return v

        think_ms = value.get("think_ms", 0)
        if not isinstance(think_ms, int) or isinstance(think_ms, bool) or think_ms < 0:
            raise BadInput("think_ms: expected a non-negative integer")
        tokens = optional("tokens", int)
        if tokens is not None and tokens < 0:
            raise BadInput("tokens: expected a non-negative integer")
        return cls(optional("text", str), optional("name", str), think_ms, tokens)


@dataclass
class Held:
    """What a session holds in memory between turns."""

    epoch: int
    history: list[str] = field(default_factory=list)
    #: The turn whose entry is the last of `history`: a resume must not append it twice.
    last_turn: str | None = None


def _history(state: Any) -> list[str]:
    if state is None:
        return []
    history = state.get("history") if isinstance(state, dict) else None
    if not isinstance(history, list) or not all(isinstance(h, str) for h in history):
        raise BadCheckpoint('the checkpoint is not {"history":[...]}')
    return history


async def _progress(session: Session) -> tuple[int, bool]:
    """Where a resumed turn picks up: the first token index its earlier attempts did not
    journal, and whether they journaled `turn_finished`."""
    if not session.resumed:
        return 0, False
    next_token, counted, finished = 0, 0, False
    for event in await session.journal_events():
        if event.type == "turn_finished":
            finished = True
        elif event.type == "token":
            counted += 1
            i = event.data.get("i") if isinstance(event.data, dict) else None
            if isinstance(i, int) and not isinstance(i, bool):
                next_token = max(next_token, i + 1)
    return max(next_token, counted), finished


class DemoAgent:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.held: dict[str, Held] = {}

    async def on_turn(self, session: Session, request: TurnRequest) -> Response:
        try:
            data = Input.parse(request.body)
        except BadInput as e:
            return JSONResponse({"error": "malformed_json", "message": str(e)}, status_code=400)
        held = self.held.get(session.key)
        try:
            return await self._run(session, request, data, held)
        except BadCheckpoint as e:
            self._forget(session.key, held)
            return JSONResponse({"error": "bad_checkpoint", "message": str(e)}, status_code=500)
        except BaseException:
            # Fenced, refused, cancelled: what we hold may be stale; the next turn thaws.
            self._forget(session.key, self.held.get(session.key))
            raise

    def _forget(self, key: str, held: Held | None) -> None:
        if held is not None and self.held.get(key) is held:
            del self.held[key]

    async def _run(
        self, session: Session, request: TurnRequest, data: Input, held: Held | None
    ) -> Response:
        if held is None or held.epoch != session.epoch:
            self._forget(session.key, held)
            try:
                state = await session.thaw_json()
            except ValueError as e:  # not JSON at all
                raise BadCheckpoint(f"the checkpoint is not JSON: {e}") from e
            last_turn = state.get("last_turn") if isinstance(state, dict) else None
            held = Held(session.epoch, _history(state), last_turn)
            self.held[session.key] = held
        if request.kind == "turn":
            entry = data.text or ""
        else:
            entry = f"event:{data.name or 'event'}"
        # A resumed turn publishes only what its earlier attempts did not journal, and
        # does not append its entry again if one of them checkpointed it.
        next_token, finished = await _progress(session)
        checkpointed = session.resumed and held.last_turn == session.turn_id
        if not session.resumed:
            await session.publish("turn_started", {"text": entry, "node": self.node_id})
        tokens = DEFAULT_TOKENS if data.tokens is None else data.tokens
        think = min(data.think_ms, MAX_THINK_MS) / 1000
        pause = think if tokens == 0 else think / tokens
        for i in range(next_token, tokens):
            await asyncio.sleep(pause)
            await session.publish("token", {"i": i, "text": f"tok{i}"})
        if tokens == 0:
            await asyncio.sleep(pause)
        history_len = len(held.history) + (0 if checkpointed else 1)
        if not finished:
            await session.publish("turn_finished", {"history_len": history_len})
        if not checkpointed:
            history = [*held.history, entry]
            stored: dict[str, Any] = {"history": history}
            if session.turn_id is not None:
                stored["last_turn"] = session.turn_id
            await session.checkpoint(stored)
            held.history, held.last_turn = history, session.turn_id
        body = {"history_len": history_len, "epoch": session.epoch, "node": self.node_id}
        return JSONResponse(body)

    def stand_down(self, key: str) -> None:
        self.held.pop(key, None)

    async def release(self, request: Request) -> Response:
        """Operator/test hook (as the Rust demo's): the session idled out; release it."""
        key = request.path_params["key"]
        held = self.held.pop(key, None)
        if held is None:
            return Response(status_code=204)
        sidecar: SidecarApi = request.app.state.agent.sidecar
        try:
            await Session(key, held.epoch, sidecar=sidecar).release()
        except LeaseholdError as e:
            return JSONResponse({"error": "release_failed", "message": str(e)}, status_code=409)
        return Response(status_code=204)


def build_app(node_id: str, sidecar_url: str = DEFAULT_SIDECAR_URL) -> Starlette:
    agent = DemoAgent(node_id)
    release = Route("/sessions/{key}/release", agent.release, methods=["POST"])
    return create_app(
        agent.on_turn,
        on_stand_down=agent.stand_down,
        sidecar_url=sidecar_url,
        routes=[release],
    )


def default_node_id(env: dict[str, str] | None = None) -> str:
    """`LEASEHOLD_NODE_ID`, else `POD_NAME`, else `HOSTNAME`, else `demo` (as the Rust
    demo agent)."""
    env = dict(os.environ) if env is None else env
    for name in ("LEASEHOLD_NODE_ID", "POD_NAME", "HOSTNAME"):
        if env.get(name):
            return env[name]
    return "demo"


def split_listen(listen: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen: {listen!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="leasehold-python-demo-agent", description="Reference agent for leasehold (Python)"
    )
    parser.add_argument(
        "--listen",
        default=os.environ.get("DEMO_AGENT_LISTEN", "127.0.0.1:3000"),
        help="where the agent listens for turns from its sidecar [env DEMO_AGENT_LISTEN]",
    )
    parser.add_argument(
        "--sidecar-url",
        default=os.environ.get("LEASEHOLD_SIDECAR_URL", DEFAULT_SIDECAR_URL),
        help="the sidecar's agent API [env LEASEHOLD_SIDECAR_URL]",
    )
    parser.add_argument(
        "--node-id",
        default=None,
        help="the node name reported in answers [env LEASEHOLD_NODE_ID, else $POD_NAME, "
        "else $HOSTNAME]",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    try:
        host, port = split_listen(args.listen)
    except ValueError as e:
        sys.exit(str(e))
    node_id = args.node_id or default_node_id()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    app = build_app(node_id, args.sidecar_url)
    logging.getLogger("leasehold.agent").info("demo agent %s on %s:%d", node_id, host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
