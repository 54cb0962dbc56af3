"""An agent whose turns survive the loss of their pod and can be interrupted.

    uvicorn resumable_agent:app --app-dir sdk/python/examples --host 127.0.0.1 --port 3000

A turn's body is `{"text": "...", "steps": 5}`. The agent publishes `turn_started`,
one `step` event per step (`{"i": n}`, the index is what a resume counts), then
`turn_finished`, checkpoints `{"history": [...], "last_turn": "<turn id>"}`, and answers
`{"history_len": n, "resumed": bool}`.

- **Resume.** If the pod running a turn dies mid-turn, the next owner gets the same turn
  again with `Leasehold-Resume`. Watchers already saw the steps the first attempt
  published (then `turn_resumed`), so it publishes only the steps not journaled, and no
  second `turn_started`. If the first attempt had checkpointed already, the history
  holds the turn: it is not appended twice.
- **Cancel.** A newer turn sent with `Leasehold-Multitask: interrupt` cancels this one:
  `session.cancelled` is set (here: the step helper stops), the handler gets
  `asyncio.CancelledError`, and nothing more of the turn is published.
"""

from __future__ import annotations

import asyncio
from typing import Any

from leasehold.agent import Session, TurnRequest, create_app


async def step(session: Session, i: int) -> str:
    """One unit of work (a model call, a tool call): stops when the turn is cancelled."""
    work = asyncio.create_task(asyncio.sleep(0.05, result=f"result {i}"))
    cancelled = asyncio.create_task(session.cancelled.wait())
    await asyncio.wait({work, cancelled}, return_when=asyncio.FIRST_COMPLETED)
    cancelled.cancel()
    if not work.done():
        work.cancel()  # e.g. abort the model call: its result is not wanted any more
        raise asyncio.CancelledError
    return work.result()


async def on_turn(session: Session, request: TurnRequest) -> Any:
    body = request.json()
    text, steps = str(body.get("text", "")), int(body.get("steps", 5))
    state = await session.thaw_json() or {"history": []}
    # A resumed turn: what its interrupted attempt published (watchers saw it already).
    journal = await session.journal_events() if session.resumed else []
    done = len({e.data["i"] for e in journal if e.type == "step"})
    if not session.resumed:
        await session.publish("turn_started", {"text": text})
    for i in range(done, steps):
        await session.publish("step", {"i": i, "result": await step(session, i)})
    if state.get("last_turn") != session.turn_id:  # not checkpointed by an earlier attempt
        state = {"history": [*state["history"], text], "last_turn": session.turn_id}
        await session.checkpoint(state)  # Fenced if this pod lost the session
    if not any(e.type == "turn_finished" for e in journal):
        await session.publish("turn_finished", {"history_len": len(state["history"])})
    return {"history_len": len(state["history"]), "resumed": session.resumed}


def cancelled(key: str, turn_id: str) -> None:
    """A newer turn interrupted `turn_id` (its handler is being cancelled)."""
    print(f"{key}: turn {turn_id} was interrupted")


app = create_app(on_turn, on_cancel=cancelled)
