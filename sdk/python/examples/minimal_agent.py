# minimal_agent.py — run with: uvicorn minimal_agent:app --host 127.0.0.1 --port 3000
from typing import Any

from leasehold.agent import Session, TurnRequest, create_app


async def on_turn(session: Session, request: TurnRequest) -> dict[str, Any]:
    state = await session.thaw_json() or {"history": []}  # GET checkpoint (None if none)
    text = request.json().get("text", "")
    await session.publish("turn_started", {"text": text})  # to every observer, any pod
    state["history"].append(text)
    await session.checkpoint(state)  # fenced by this turn's epoch
    await session.publish("turn_finished", {"history_len": len(state["history"])})
    return {"history_len": len(state["history"]), "epoch": session.epoch}


app = create_app(on_turn)  # the sidecar: $LEASEHOLD_SIDECAR_URL, else http://127.0.0.1:8082
