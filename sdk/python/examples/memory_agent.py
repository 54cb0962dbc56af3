"""An agent that keeps each session's history in memory between turns and reads the
checkpoint only when it does not hold the session at this turn's epoch.

    uvicorn memory_agent:app --app-dir sdk/python/examples --host 127.0.0.1 --port 3000

A turn's body is `{"text": "..."}`; an event's `{"name": "..."}` is recorded as
`event:<name>`. The agent publishes `turn_started`, one `token` per word, then
`turn_finished`, and answers `{"history_len": n, "epoch": e}`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from leasehold.agent import Session, TurnRequest, create_app


@dataclass
class Held:
    """A session's state as this process last saw it, and the epoch it saw it at."""

    epoch: int
    history: list[str] = field(default_factory=list)


held: dict[str, Held] = {}


async def load(session: Session) -> Held:
    """The session's state: from memory if we held it at this epoch, else thawed."""
    state = held.get(session.key)
    if state is not None and state.epoch == session.epoch:
        return state
    # A new epoch: another pod may have run turns since we last held the session, so
    # what we hold is stale. The checkpoint is the truth.
    stored = await session.thaw_json()
    state = Held(session.epoch, list(stored["history"]) if stored else [])
    held[session.key] = state
    return state


async def on_turn(session: Session, request: TurnRequest) -> Any:
    try:
        body = request.json() if request.body.strip() else {}
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return 400, {"error": "malformed_json"}  # never 409: the sidecar reads it as fenced
    if request.kind == "event":
        text = f"event:{body.get('name', 'event')}"
    else:
        text = str(body.get("text", ""))
    state = await load(session)
    try:
        await session.publish("turn_started", {"text": text})
        for word in text.split():
            await asyncio.sleep(0.05)  # a stand-down cancels the turn here
            await session.publish("token", {"text": word})
        history = [*state.history, text]
        await session.checkpoint({"history": history})  # Fenced if we lost the session
        await session.publish("turn_finished", {"history_len": len(history)})
    except BaseException:
        # Fenced, cancelled by a stand-down, or the sidecar refused: what we hold may be
        # behind the checkpoint. Forget it (the next turn thaws) and let the SDK answer.
        held.pop(session.key, None)
        raise
    state.history = history
    return {"history_len": len(history), "epoch": session.epoch}


def stand_down(key: str) -> None:
    """The sidecar no longer owns `key`: drop what we hold of it."""
    held.pop(key, None)


app = create_app(on_turn, on_stand_down=stand_down)
