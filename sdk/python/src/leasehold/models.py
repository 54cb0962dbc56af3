"""Plain data returned by the client: answers, session and turn views, stream events."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Control events (no `id`) a stream yields. `reconnect` is handled inside the stream and
#: never yielded.
IDLE = "idle"
OVERFLOW = "overflow"
RECONNECT = "reconnect"


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of a session's stream.

    `id` is `"<epoch>-<seq>"` for events the agent published; control events (`idle`:
    no one owns the session; `overflow`: this reader fell behind and the stream resumes
    from `Last-Event-ID`, see `EventStream`) have `id=None`. `data` is the parsed JSON
    (the raw text when it is not JSON)."""

    id: str | None
    type: str
    data: Any
    raw: str = field(default="", repr=False, compare=False)

    @property
    def control(self) -> bool:
        """A control event of the stream itself, not one the agent published."""
        return self.id is None

    @property
    def epoch(self) -> int | None:
        return _id_part(self.id, 0)

    @property
    def seq(self) -> int | None:
        return _id_part(self.id, 1)


def _id_part(event_id: str | None, index: int) -> int | None:
    if event_id is None:
        return None
    parts = event_id.split("-", 1)
    try:
        return int(parts[index]) if len(parts) == 2 else None
    except ValueError:
        return None


def event_from_frame(event_id: str | None, event_type: str | None, data: str) -> Event:
    try:
        parsed: Any = json.loads(data) if data else None
    except ValueError:
        parsed = data
    return Event(id=event_id, type=event_type or "message", data=parsed, raw=data)


@dataclass(frozen=True)
class SessionInfo:
    """`GET /v1/sessions/{key}`: who owns the session now (a read, never a claim)."""

    key: str
    owner: str | None
    epoch: int | None
    expires_in_ms: int | None
    claimable: bool

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SessionInfo:
        return cls(
            key=str(data["key"]),
            owner=data.get("owner"),
            epoch=data.get("epoch"),
            expires_in_ms=data.get("expires_in_ms"),
            claimable=bool(data.get("claimable", False)),
        )


@dataclass(frozen=True)
class TurnAnswer:
    """A finished turn's recorded answer: what its client got (or would have got)."""

    status: int
    content_type: str | None
    body: Any

    def json(self) -> Any:
        """The body parsed as JSON when it is JSON text, else as it came."""
        if isinstance(self.body, str):
            try:
                return json.loads(self.body)
            except ValueError:
                return self.body
        return self.body

    @classmethod
    def from_json(cls, data: Any) -> TurnAnswer | None:
        if not isinstance(data, Mapping):
            return None
        status = data.get("status")
        content_type = data.get("content_type")
        return cls(
            status=status if isinstance(status, int) else 0,
            content_type=content_type if isinstance(content_type, str) else None,
            body=data.get("body"),
        )


@dataclass(frozen=True)
class TurnInfo:
    """`GET /v1/sessions/{key}/turns/{id}` (docs/http-api.md): a turn's state (`running`,
    `finished`, `interrupted`, `cancelled`), the epoch of its latest attempt, how many
    attempts it took, and its recorded answer once finished. `raw` is the whole JSON
    object."""

    turn_id: str
    state: str
    epoch: int | None
    answer: TurnAnswer | None
    raw: Mapping[str, Any]
    attempts: int | None = None

    @property
    def finished(self) -> bool:
        return self.state == "finished"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TurnInfo:
        attempts = data.get("attempts")
        return cls(
            turn_id=str(data.get("turn_id", "")),
            state=str(data.get("state", "")),
            epoch=data.get("epoch"),
            answer=TurnAnswer.from_json(data.get("answer")),
            raw=dict(data),
            attempts=attempts if isinstance(attempts, int) else None,
        )


@dataclass(frozen=True)
class TurnResponse:
    """The agent's answer to a turn or event, after any directed retries.

    `owner`/`epoch` come from `Leasehold-Owner`/`Leasehold-Epoch`; `replayed` is
    `Leasehold-Replayed: true` (an exactly-once replay, docs/http-api.md); `directives` lists
    the refusal codes obeyed on the way; `url` is the base URL that answered."""

    status: int
    headers: Mapping[str, str]
    content: bytes
    idempotency_key: str
    owner: str | None
    epoch: int | None
    replayed: bool
    directives: list[str]
    url: str

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)
