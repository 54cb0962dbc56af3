"""The agent side: an ASGI app that serves docs/http-api.md and a `Session` over §5.

    from leasehold.agent import Session, TurnRequest, create_app

    async def on_turn(session: Session, request: TurnRequest) -> dict:
        state = await session.thaw_json() or {"history": []}
        await session.publish("turn_started", {"text": request.json()["text"]})
        state["history"].append(request.json()["text"])
        await session.checkpoint(state)          # fenced: raises Fenced if we lost the session
        return {"history_len": len(state["history"])}

    app = create_app(on_turn)                    # uvicorn module:app --port 3000

What the app does for you:

- Routes `POST /sessions/{key}/turns` and `/events` to your handler with a `Session` bound
  to the turn's `Leasehold-Epoch`, `Leasehold-Turn-Id` and `Leasehold-Resume`, one turn of
  a session at a time (in arrival order).
- `POST /sessions/{key}/stand-down` (the sidecar lost the session) cancels the session's
  running handler (`asyncio.CancelledError` inside it) and calls `on_stand_down(key)` so
  you can drop in-memory state; the cancelled turn is answered `409 {"error":"fenced"}`.
- `POST /sessions/{key}/turns/{turn_id}/cancel` (a newer turn interrupted it) stops that
  turn: `session.cancelled` is set, `on_cancel(key, turn_id)` is called, and the handler
  is cancelled (`asyncio.CancelledError` at its current `await`). From then on every
  write of that session handle raises `Interrupted` without being sent, so nothing more
  of the turn is published. The cancel is answered `204` once the handler has ended
  (within `CANCEL_WAIT`); the turn is answered `409 {"error":"interrupted"}` (the sidecar
  answers the client itself).
- A turn re-dispatched after its owner was lost mid-turn carries `Leasehold-Resume`:
  `session.resumed` is true, and `await session.journal_events()` returns what its
  earlier attempts published (the sidecar already showed those to watchers, then
  `turn_resumed`): publish only the rest, and no second `turn_started`.
- A `Fenced` raised out of the handler is answered `409 {"error":"fenced"}` (the sidecar
  turns it into a `fenced` directive for the client, or `owner_failed` if something was
  already checkpointed). A sidecar refusal (`503` with a directive, e.g. the lease store is
  unreachable) raised out of the handler is passed back as it came, so the client retries.
  A sidecar that cannot be reached is `502 {"error":"sidecar_unreachable"}`; any other
  exception `500 {"error":"agent_error"}` (and logged).

The handler returns a Starlette `Response`, or: `dict`/`list` (JSON, 200), `str` (text),
`bytes`, `None` (204), or `(status, body)` with a body of those kinds.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias
from urllib.parse import quote

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ._policy import directive_of, error_for
from .errors import Fenced, HttpError, Interrupted, LeaseholdError
from .models import Event, event_from_frame

log = logging.getLogger("leasehold.agent")

EPOCH_HEADER = "leasehold-epoch"
TURN_ID_HEADER = "leasehold-turn-id"
RESUME_HEADER = "leasehold-resume"
CHECKPOINT_EPOCH_HEADER = "leasehold-checkpoint-epoch"
CHECKPOINT_TURN_HEADER = "leasehold-checkpoint-turn"
DEFAULT_SIDECAR_URL = "http://127.0.0.1:8082"

#: Headers of the hop to the agent, not the client's.
_NOT_CLIENT_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-type",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "idempotency-key",
    }
)

#: Local calls to the sidecar: it bounds its own statements by 5 s, so this is ample.
SIDECAR_TIMEOUT = httpx.Timeout(30.0, connect=1.0)
#: How long a cancel (or stand-down) waits for the handler to end before it answers anyway.
CANCEL_WAIT = 3.0  # under the sidecar's 5 s limit on the notification


class SidecarUnreachable(LeaseholdError):
    """The sidecar's agent API could not be reached (or did not answer)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="sidecar_unreachable")


@dataclass(frozen=True)
class Checkpoint:
    """A stored checkpoint: its bytes, the epoch that wrote them and, when it was written
    during a turn, that turn's id (`Leasehold-Checkpoint-Turn`)."""

    data: bytes
    epoch: int | None
    turn_id: str | None = None


class SidecarApi:
    """The sidecar's agent API (docs/http-api.md), one call per method. Writes carry the
    epoch; `409 fenced` raises `Fenced`; other refusals raise `HttpError` (with the
    directive, if any); a sidecar that cannot be reached raises `SidecarUnreachable`."""

    def __init__(
        self, base_url: str = DEFAULT_SIDECAR_URL, *, http: httpx.AsyncClient | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._owns_http = http is None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=SIDECAR_TIMEOUT)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None and self._owns_http:
            await self._http.aclose()
            self._http = None

    def _url(self, key: str, rest: str) -> str:
        return f"{self.base_url}/v1/sessions/{key}/{rest}"

    async def _send(
        self, method: str, url: str, *, content: bytes | None = None, epoch: int | None = None
    ) -> httpx.Response:
        headers = {EPOCH_HEADER: str(epoch)} if epoch is not None else {}
        if content is not None and method != "PUT":
            headers["content-type"] = "application/json"
        try:
            return await self._client().request(method, url, content=content, headers=headers)
        except httpx.TransportError as e:
            raise SidecarUnreachable(f"{method} {url}: {e!r}") from e

    @staticmethod
    def _check(response: httpx.Response) -> httpx.Response:
        if response.is_success:
            return response
        headers = {k.lower(): v for k, v in response.headers.items()}
        directive = directive_of(response.status_code, headers, response.content, 30.0)
        raise error_for(response.status_code, headers, response.content, directive)

    async def get_checkpoint(self, key: str) -> Checkpoint | None:
        response = await self._send("GET", self._url(key, "checkpoint"))
        if response.status_code == 404:
            return None
        self._check(response)
        epoch = response.headers.get(CHECKPOINT_EPOCH_HEADER)
        return Checkpoint(
            response.content,
            int(epoch) if epoch and epoch.isdigit() else None,
            response.headers.get(CHECKPOINT_TURN_HEADER),
        )

    async def put_checkpoint(self, key: str, epoch: int, data: bytes) -> None:
        self._check(
            await self._send("PUT", self._url(key, "checkpoint"), content=data, epoch=epoch)
        )

    async def publish(self, key: str, epoch: int, event_type: str, data: Any = None) -> str:
        if not event_type or "\n" in event_type or "\r" in event_type:
            raise ValueError("an event type is one non-empty line")
        body = json.dumps({"type": event_type, "data": data}, default=_jsonable).encode()
        response = self._check(
            await self._send("POST", self._url(key, "events"), content=body, epoch=epoch)
        )
        event_id = response.json().get("id")
        return str(event_id)

    async def journal_events(self, key: str, turn_id: str, epoch: int | None = None) -> list[Event]:
        """`GET /v1/sessions/{key}/turns/{turn_id}/events` with `Leasehold-Epoch: epoch`:
        the journaled events of the turn's attempts at epochs below `epoch`, oldest first.
        `404` (no such turn, or a sidecar without the journal) is `[]`."""
        url = self._url(key, f"turns/{quote(turn_id, safe='')}/events")
        response = await self._send("GET", url, epoch=epoch)
        if response.status_code == 404:
            return []
        self._check(response)
        events: list[Event] = []
        for item in response.json():
            data = item.get("data")
            raw = data if isinstance(data, str) else json.dumps(data)
            event = event_from_frame(item.get("id"), item.get("type"), raw)
            events.append(event)
        return events

    async def release(self, key: str, epoch: int) -> None:
        self._check(await self._send("DELETE", self._url(key, "lease"), epoch=epoch))


def _jsonable(value: Any) -> Any:
    """`json.dumps` fallback for objects that know how to describe themselves."""
    for method in ("model_dump", "dict", "to_json"):
        fn = getattr(value, method, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                return fn()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return repr(value)


class Session:
    """One turn's handle on its session: every write carries the turn's epoch and is
    fenced by the sidecar. After one `Fenced`, every later write raises `Fenced` at once
    without being sent (the turn must stop; nothing more may land)."""

    def __init__(
        self,
        key: str,
        epoch: int,
        *,
        sidecar: SidecarApi | str = DEFAULT_SIDECAR_URL,
        turn_id: str | None = None,
        resume_of: str | None = None,
    ) -> None:
        self.key = key
        self.epoch = epoch
        self.turn_id = turn_id
        self.resume_of = resume_of
        self.sidecar = SidecarApi(sidecar) if isinstance(sidecar, str) else sidecar
        self.fenced = False
        #: The epoch that wrote the checkpoint last thawed (`None` before a thaw or if none).
        self.checkpoint_epoch: int | None = None
        #: The turn that wrote it, when written during a turn (`Leasehold-Checkpoint-Turn`):
        #: a resumed turn finds its own id here if its earlier attempt's checkpoint landed.
        self.checkpoint_turn: str | None = None
        #: Set when the sidecar cancelled this turn (a newer turn interrupted it) or stood
        #: the session down: await it in helper tasks that must stop with the turn.
        self.cancelled = asyncio.Event()
        #: Why: `"interrupted"` (`POST …/turns/{id}/cancel`) or `"fenced"` (stand-down).
        self.cancel_reason: str | None = None

    def __repr__(self) -> str:
        return f"Session(key={self.key!r}, epoch={self.epoch}, turn_id={self.turn_id!r})"

    @property
    def resumed(self) -> bool:
        """This turn was re-dispatched after its owner was lost mid-turn
        (`Leasehold-Resume`): its earlier attempts' events are in `journal_events()`."""
        return self.resume_of is not None

    def cancel(self, reason: str) -> None:
        """Mark the turn stopped from outside (the app calls this on a cancel or a
        stand-down): `cancelled` is set and later writes raise without being sent."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
        if reason == "fenced":
            self.fenced = True
        self.cancelled.set()

    async def _write(self, call: Awaitable[Any]) -> Any:
        if self.fenced or self.cancel_reason is not None:
            if inspect.iscoroutine(call):
                call.close()
            if self.cancel_reason == "interrupted":
                raise Interrupted(
                    409,
                    "interrupted",
                    b'{"error":"interrupted"}',
                    message=f"turn {self.turn_id} of {self.key} was cancelled",
                )
            raise Fenced(message=f"session {self.key} at epoch {self.epoch} was fenced")
        try:
            return await call
        except Fenced:
            self.fenced = True
            raise

    async def thaw(self) -> bytes | None:
        """The session's checkpoint as stored, or `None` when there is none."""
        checkpoint = await self.sidecar.get_checkpoint(self.key)
        if checkpoint is None:
            return None
        self.checkpoint_epoch = checkpoint.epoch
        self.checkpoint_turn = checkpoint.turn_id
        return checkpoint.data

    async def thaw_json(self) -> Any:
        """The checkpoint parsed as JSON, or `None` when there is none."""
        data = await self.thaw()
        return None if data is None else json.loads(data)

    async def checkpoint(self, state: Any) -> None:
        """Store the session's state (bytes as they are, `str` as UTF-8, else JSON).
        Raises `Fenced` if this epoch no longer owns the session."""
        if isinstance(state, bytes | bytearray | memoryview):
            data = bytes(state)
        elif isinstance(state, str):
            data = state.encode()
        else:
            data = json.dumps(state, default=_jsonable).encode()
        await self._write(self.sidecar.put_checkpoint(self.key, self.epoch, data))

    async def publish(self, event_type: str, data: Any = None) -> str:
        """Publish an event to every observer on every node; returns its id
        (`<epoch>-<seq>`). Raises `Fenced` if this epoch no longer owns the session."""
        event_id: str = await self._write(
            self.sidecar.publish(self.key, self.epoch, event_type, data)
        )
        return event_id

    async def journal_events(self) -> list[Event]:
        """The journaled events of this turn's earlier attempts (epochs below this one),
        oldest first, to continue a resumed turn (`resumed` is true): publish only what
        they lack. `[]` when there are none — also what a sidecar without the turn
        journal answers (`404`)."""
        turn_id = self.resume_of or self.turn_id
        if turn_id is None:
            return []
        return await self.sidecar.journal_events(self.key, turn_id, self.epoch)

    async def release(self) -> None:
        """The session idled out: release its lease (claimable at once by any node)."""
        await self._write(self.sidecar.release(self.key, self.epoch))


@dataclass(frozen=True)
class TurnRequest:
    """A turn (or event) as the sidecar dispatched it.

    `headers` are the client's allow-listed headers that reached the agent (lower-case
    names: `authorization`, `traceparent`, ...), without the hop's own and `leasehold-*`."""

    key: str
    kind: Literal["turn", "event"]
    turn_id: str | None
    epoch: int
    body: bytes
    content_type: str | None
    headers: Mapping[str, str] = field(default_factory=dict)
    resume_of: str | None = None

    @property
    def resumed(self) -> bool:
        """Re-dispatched after its owner was lost mid-turn (`Leasehold-Resume`)."""
        return self.resume_of is not None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")

    @property
    def traceparent(self) -> str | None:
        return self.headers.get("traceparent")


Reply: TypeAlias = Response | Mapping[str, Any] | list[Any] | str | bytes | tuple[int, Any] | None
Handler: TypeAlias = Callable[[Session, TurnRequest], Awaitable[Reply]]
StandDownHook: TypeAlias = Callable[[str], Awaitable[None] | None]
#: `on_cancel(key, turn_id)`: the sidecar cancelled that turn (a newer one interrupted it).
CancelHook: TypeAlias = Callable[[str, str], Awaitable[None] | None]


def _error(status: int, code: str, message: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": code}
    if message is not None:
        body["message"] = message
    return JSONResponse(body, status_code=status)


def to_response(reply: Reply) -> Response:
    """The HTTP answer for what a handler returned."""
    status = 200
    if isinstance(reply, tuple):
        status, reply = reply
    if isinstance(reply, Response):
        if status != 200:
            reply.status_code = status
        return reply
    if reply is None:
        return Response(status_code=204 if status == 200 else status)
    if isinstance(reply, str):
        return PlainTextResponse(reply, status_code=status)
    if isinstance(reply, bytes | bytearray):
        return Response(bytes(reply), status_code=status, media_type="application/octet-stream")
    return Response(
        json.dumps(reply, default=_jsonable, separators=(",", ":")),
        status_code=status,
        media_type="application/json",
    )


@dataclass
class _Running:
    task: asyncio.Task[Reply]
    turn_id: str | None
    session: Session
    #: Why it was cancelled from outside: "fenced" (stand-down) or "interrupted".
    reason: str | None = None

    def stop(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.session.cancel(reason)
        self.task.cancel()


async def _call_hook(name: str, hook: Callable[..., Any], *args: Any) -> None:
    try:
        result = hook(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:  # what the hook reacts to happened; its failure is logged
        log.exception("%s%r failed", name, args)


async def _ended(tasks: list[asyncio.Task[Reply]]) -> None:
    """Wait (bounded) until the cancelled handlers have ended."""
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=CANCEL_WAIT)
        if pending:
            log.warning(
                "%d cancelled handler(s) still running after %ss", len(pending), CANCEL_WAIT
            )


@dataclass
class _Slot:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: list[_Running] = field(default_factory=list)


class AgentApp:
    """The state behind `create_app`: one slot per session (its turn lock and running
    handlers). `app.state.agent` on the Starlette app."""

    def __init__(
        self,
        on_turn: Handler,
        *,
        on_event: Handler | None,
        on_stand_down: StandDownHook | None,
        sidecar: SidecarApi,
        on_cancel: CancelHook | None = None,
    ) -> None:
        self.on_turn = on_turn
        self.on_event = on_event
        self.on_stand_down = on_stand_down
        self.on_cancel = on_cancel
        self.sidecar = sidecar
        self.slots: dict[str, _Slot] = {}

    def _slot(self, key: str) -> _Slot:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _Slot()
        return slot

    def _forget_if_idle(self, key: str, slot: _Slot) -> None:
        if not slot.running and not slot.lock.locked() and self.slots.get(key) is slot:
            del self.slots[key]

    async def dispatch(self, request: Request, kind: Literal["turn", "event"]) -> Response:
        key = request.path_params["key"]
        raw_epoch = request.headers.get(EPOCH_HEADER, "")
        if not raw_epoch.isdigit() or int(raw_epoch) < 1:
            return _error(400, "missing_epoch", "Leasehold-Epoch header is required")
        epoch = int(raw_epoch)
        turn_id = request.headers.get(TURN_ID_HEADER)
        resume_of = request.headers.get(RESUME_HEADER)
        headers = {
            k.lower(): v
            for k, v in request.headers.items()
            if k.lower() not in _NOT_CLIENT_HEADERS and not k.lower().startswith("leasehold-")
        }
        turn = TurnRequest(
            key=key,
            kind=kind,
            turn_id=turn_id,
            epoch=epoch,
            body=await request.body(),
            content_type=request.headers.get("content-type"),
            headers=headers,
            resume_of=resume_of,
        )
        session = Session(key, epoch, sidecar=self.sidecar, turn_id=turn_id, resume_of=resume_of)
        handler = self.on_event if kind == "event" and self.on_event is not None else self.on_turn
        slot = self._slot(key)

        async def run() -> Reply:
            async with slot.lock:  # one turn of a session at a time, in arrival order
                return await handler(session, turn)

        running = _Running(asyncio.create_task(run()), turn_id, session)
        slot.running.append(running)
        try:
            await asyncio.wait({running.task})
        except asyncio.CancelledError:
            running.task.cancel()  # the server is shutting down: so is the turn
            raise
        finally:
            slot.running.remove(running)
            self._forget_if_idle(key, slot)
        return self._answer(running, session)

    def _answer(self, running: _Running, session: Session) -> Response:
        if running.reason is not None:
            if not running.task.cancelled() and running.task.exception() is None:
                log.info("%s: turn %s finished after it was cancelled", session, running.turn_id)
            return _error(409, running.reason)
        if running.task.cancelled():
            return _error(409, "fenced")
        error = running.task.exception()
        if error is None:
            return to_response(running.task.result())
        if isinstance(error, Fenced):
            log.info("%s: fenced; the turn stops", session)
            return _error(409, "fenced")
        if isinstance(error, HttpError) and error.status == 503 and error.directive is not None:
            # A sidecar refusal (e.g. the lease store is unreachable): passed back as is.
            seconds = max(1, -(-error.directive.delay_ms // 1000))
            return Response(
                error.body,
                status_code=503,
                media_type="application/json",
                headers={"retry-after": str(seconds)},
            )
        if isinstance(error, SidecarUnreachable):
            log.warning("%s: %s", session, error)
            return _error(502, "sidecar_unreachable", str(error))
        log.error("%s: the handler failed", session, exc_info=error)
        return _error(500, "agent_error", f"{type(error).__name__}: {error}")

    async def stand_down(self, request: Request) -> Response:
        key = request.path_params["key"]
        slot = self.slots.get(key)
        stopped = list(slot.running) if slot else []
        for running in stopped:
            running.stop("fenced")
        if self.on_stand_down is not None:
            await _call_hook("on_stand_down", self.on_stand_down, key)
        await _ended([r.task for r in stopped])
        log.info("session %s stood down", key)
        return Response(status_code=204)

    async def cancel(self, request: Request) -> Response:
        key, turn_id = request.path_params["key"], request.path_params["turn_id"]
        slot = self.slots.get(key)
        stopped = [r for r in (slot.running if slot else []) if r.turn_id == turn_id]
        for running in stopped:
            running.stop("interrupted")
        if stopped and self.on_cancel is not None:
            await _call_hook("on_cancel", self.on_cancel, key, turn_id)
        await _ended([r.task for r in stopped])
        log.info("turn %s of %s cancelled (%s running)", turn_id, key, len(stopped))
        return Response(status_code=204)


def create_app(
    on_turn: Handler,
    *,
    on_event: Handler | None = None,
    on_stand_down: StandDownHook | None = None,
    on_cancel: CancelHook | None = None,
    sidecar_url: str | None = None,
    http_client: httpx.AsyncClient | None = None,
    routes: Sequence[BaseRoute] = (),
) -> Starlette:
    """The agent's ASGI app (Starlette). `on_turn` serves turns, and events too unless
    `on_event` is given (`request.kind` tells them apart); `on_stand_down(key)` is called
    when the sidecar lost a session, after its running handler was cancelled;
    `on_cancel(key, turn_id)` when the sidecar cancelled a running turn (a newer one
    interrupted it), likewise; `routes` are added to the app (e.g. health checks).
    `sidecar_url` defaults to `$LEASEHOLD_SIDECAR_URL`, else `http://127.0.0.1:8082`."""
    url = sidecar_url or os.environ.get("LEASEHOLD_SIDECAR_URL") or DEFAULT_SIDECAR_URL
    sidecar = SidecarApi(url, http=http_client)
    agent = AgentApp(
        on_turn,
        on_event=on_event,
        on_stand_down=on_stand_down,
        sidecar=sidecar,
        on_cancel=on_cancel,
    )

    async def turns(request: Request) -> Response:
        return await agent.dispatch(request, "turn")

    async def events(request: Request) -> Response:
        return await agent.dispatch(request, "event")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await sidecar.aclose()

    app = Starlette(
        routes=[
            Route("/sessions/{key}/turns", turns, methods=["POST"]),
            Route("/sessions/{key}/events", events, methods=["POST"]),
            Route("/sessions/{key}/stand-down", agent.stand_down, methods=["POST"]),
            Route("/sessions/{key}/turns/{turn_id}/cancel", agent.cancel, methods=["POST"]),
            *routes,
        ],
        lifespan=lifespan,
    )
    app.state.agent = agent
    return app
