"""Clients of the public API (docs/http-api.md): `Client` (blocking) and `AsyncClient`.

    client = leasehold.Client(["http://10.0.0.1:8080", "http://10.0.0.2:8080"])
    answer = client.send_turn("chat-42", {"text": "hello"})
    print(answer.owner, answer.epoch, answer.json())
    for event in client.stream("chat-42"):
        print(event.id, event.type, event.data)

Every turn gets an `Idempotency-Key` (a uuid4 unless given) that all of its attempts
carry, with the matching `Leasehold-Turn-Id`. A `503` with a retry directive is re-sent
after `delay_ms` (to the next base URL) until `budget_ms` after the first attempt, then
`RetryBudgetExhausted` is raised; a connection refused goes to the next base URL.

An answer that may mean "it ran" — `502 owner_failed`, or the connection lost after the
turn was sent (reset, closed before the answer) — is re-sent with the same
Idempotency-Key, at most `owner_failed_retries` times (3), `owner_failed_delay` apart,
within `owner_failed_budget`: the server runs a key once and answers a repeat with the
recorded answer (`answer.replayed`), or attaches it to the attempt still running. Then
it is raised as `OwnerFailed` / `ConnectionLost`. `retry_owner_failed=False` turns this
off: do so against a sidecar that does not record idempotency keys (before the turn
journal), where a re-sent turn may run twice. A read timeout is never re-sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import httpx

from ._policy import (
    IDEMPOTENCY_KEY_RE,
    MULTITASK,
    Answer,
    Attempts,
    Multitask,
    Nodes,
    Options,
    StreamPlan,
    check_key,
    encode_body,
    error_for,
    turn_id_for,
)
from .errors import ConnectionLost, NotFound
from .models import Event, SessionInfo, TurnInfo, TurnResponse
from .sse import SSEParser

#: Failures where the request never left: the next node may be tried.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: Failures after a request was sent that lose its answer: a turn may have run; re-sent
#: with the same Idempotency-Key when allowed. (A timeout is not one: the turn is slow.)
_LOST = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
#: Failures of a stream's connection once it was open: reconnect with Last-Event-ID.
_STREAM_DROPPED = (httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError)

DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=1.0)
#: The sidecar sends a keep-alive comment every 15 s: 45 s of silence is a dead connection.
DEFAULT_STREAM_TIMEOUT = httpx.Timeout(10.0, read=45.0, connect=1.0)


def _turn_request(
    key: str,
    kind: str,
    body: Any,
    content_type: str | None,
    idempotency_key: str | None,
    multitask: Multitask | None,
    headers: Mapping[str, str] | None,
    defaults: Mapping[str, str],
) -> tuple[str, bytes, dict[str, str], str]:
    check_key(key)
    idem = idempotency_key if idempotency_key is not None else str(uuid.uuid4())
    if not IDEMPOTENCY_KEY_RE.fullmatch(idem):
        raise ValueError("an Idempotency-Key is 1-255 visible ASCII characters")
    if multitask is not None and multitask not in MULTITASK:
        raise ValueError(f"multitask must be one of {MULTITASK}")
    content, ctype = encode_body(body, content_type)
    sent = {**defaults, **{k.lower(): v for k, v in (headers or {}).items()}}
    sent.update(
        {"content-type": ctype, "idempotency-key": idem, "leasehold-turn-id": turn_id_for(idem)}
    )
    if multitask is not None:
        sent["leasehold-multitask"] = multitask
    return f"/v1/sessions/{key}/{kind}", content, sent, idem


def _turn_response(answer: Answer, idem: str) -> TurnResponse:
    if not 200 <= answer.status < 300:
        raise error_for(answer.status, answer.headers, answer.content)
    epoch = answer.headers.get("leasehold-epoch")
    return TurnResponse(
        status=answer.status,
        headers=answer.headers,
        content=answer.content,
        idempotency_key=idem,
        owner=answer.headers.get("leasehold-owner"),
        epoch=int(epoch) if epoch and epoch.lstrip("-").isdigit() else None,
        replayed=answer.headers.get("leasehold-replayed", "").lower() == "true",
        directives=answer.directives,
        url=answer.url,
    )


def _session_info(answer: Answer) -> SessionInfo:
    if answer.status != 200:
        raise error_for(answer.status, answer.headers, answer.content)
    return SessionInfo.from_json(json.loads(answer.content))


def _turn_info(answer: Answer) -> TurnInfo | None:
    if answer.status == 404:
        return None
    if answer.status != 200:
        raise error_for(answer.status, answer.headers, answer.content)
    return TurnInfo.from_json(json.loads(answer.content))


def _turn_path(key: str, turn_id: str) -> str:
    if not IDEMPOTENCY_KEY_RE.fullmatch(turn_id):
        raise ValueError("a turn id is 1-255 visible ASCII characters")
    return f"/v1/sessions/{check_key(key)}/turns/{quote(turn_id, safe='')}"


def _cancelled(answer: Answer) -> bool:
    if 200 <= answer.status < 300:
        return True
    error = error_for(answer.status, answer.headers, answer.content)
    if isinstance(error, NotFound):
        return False
    raise error


def _headers(response: httpx.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items()}


def _options(
    retry_owner_failed: bool,
    owner_failed_retries: int,
    owner_failed_delay: float,
    owner_failed_budget: float,
    retry_after_budget: float,
    reconnect_budget: float,
    headers: Mapping[str, str] | None,
) -> Options:
    if owner_failed_retries < 0:
        raise ValueError("owner_failed_retries must be >= 0")
    return Options(
        retry_owner_failed=retry_owner_failed,
        owner_failed_retries=owner_failed_retries,
        owner_failed_delay=owner_failed_delay,
        owner_failed_budget=owner_failed_budget,
        retry_after_budget=retry_after_budget,
        reconnect_budget=reconnect_budget,
        headers={k.lower(): v for k, v in (headers or {}).items()},
    )


class Client:
    """A blocking client over one or more node base URLs (round robin).

    Args:
        base_urls: one URL (a load balancer) or every node's public URL.
        timeout: per attempt (httpx); connect failures within `connect` go to the next URL.
        headers: sent with every request (e.g. `Authorization`); per-call headers win.
        retry_owner_failed: re-send a turn that may have run (`502 owner_failed`, a lost
            connection) with the same Idempotency-Key (see the module docstring); on by
            default, `owner_failed_retries` times at most.
        retry_after_budget: the budget of a `503` that has `Retry-After` but no directive.
        reconnect_budget: how long a stream keeps trying to reconnect before it raises.
        stream_timeout: timeouts of a stream's connection (`read` must exceed the 15 s
            keep-alive).
        http_client: an `httpx.Client` to use (its base URL is ignored).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        retry_owner_failed: bool = True,
        owner_failed_retries: int = 3,
        owner_failed_delay: float = 0.5,
        owner_failed_budget: float = 30.0,
        retry_after_budget: float = 30.0,
        reconnect_budget: float = 60.0,
        stream_timeout: httpx.Timeout = DEFAULT_STREAM_TIMEOUT,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.nodes = Nodes(base_urls)
        self.options = _options(
            retry_owner_failed,
            owner_failed_retries,
            owner_failed_delay,
            owner_failed_budget,
            retry_after_budget,
            reconnect_budget,
            headers,
        )
        self._stream_timeout = stream_timeout
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=timeout)

    @property
    def base_urls(self) -> list[str]:
        return list(self.nodes.urls)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        owner_failed_retry: bool = False,
    ) -> Answer:
        attempts = Attempts(self.nodes, self.options, owner_failed_retry=owner_failed_retry)
        sent_headers = dict(headers) if headers is not None else dict(self.options.headers)
        while True:
            url = attempts.base_url + path
            try:
                response = self._http.request(method, url, content=content, headers=sent_headers)
            except _NOT_SENT as e:
                attempts.connect_failed(e)
                continue
            except httpx.TransportError as e:
                delay = attempts.connection_lost() if isinstance(e, _LOST) else None
                if delay is None:
                    raise ConnectionLost(f"{method} {url}: {e!r}", url=url) from e
                time.sleep(delay)
                continue
            outcome = attempts.answered(response.status_code, _headers(response), response.content)
            if isinstance(outcome, Answer):
                return outcome
            time.sleep(outcome)

    def send_turn(
        self,
        key: str,
        body: Any,
        *,
        content_type: str | None = None,
        idempotency_key: str | None = None,
        multitask: Multitask | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> TurnResponse:
        """`POST /v1/sessions/{key}/turns`. `body`: bytes as they are, `str` as UTF-8
        text, anything else as JSON. Raises a `LeaseholdError` unless the answer is 2xx."""
        path, content, sent, idem = _turn_request(
            key,
            "turns",
            body,
            content_type,
            idempotency_key,
            multitask,
            headers,
            self.options.headers,
        )
        answer = self._request("POST", path, content=content, headers=sent, owner_failed_retry=True)
        return _turn_response(answer, idem)

    def send_event(
        self,
        key: str,
        body: Any,
        *,
        content_type: str | None = None,
        idempotency_key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> TurnResponse:
        """`POST /v1/sessions/{key}/events`: an event from elsewhere in the product (always
        enqueued behind a running turn, docs/http-api.md)."""
        path, content, sent, idem = _turn_request(
            key, "events", body, content_type, idempotency_key, None, headers, self.options.headers
        )
        answer = self._request("POST", path, content=content, headers=sent, owner_failed_retry=True)
        return _turn_response(answer, idem)

    def session(self, key: str) -> SessionInfo:
        """`GET /v1/sessions/{key}`: the session's owner now (a read, never a claim)."""
        return _session_info(self._request("GET", f"/v1/sessions/{check_key(key)}"))

    def get_turn(self, key: str, turn_id: str) -> TurnInfo | None:
        """`GET /v1/sessions/{key}/turns/{turn_id}` (docs/http-api.md): the turn's state
        and, once finished, its recorded answer; `None` on `404`. `turn_id` is the turn's
        Idempotency-Key (`answer.idempotency_key`)."""
        return _turn_info(self._request("GET", _turn_path(key, turn_id)))

    def turn(self, key: str, turn_id: str) -> TurnInfo | None:
        """The same as `get_turn`."""
        return self.get_turn(key, turn_id)

    def cancel_turn(self, key: str, turn_id: str) -> bool:
        """`DELETE /v1/sessions/{key}/turns/{turn_id}`: cancel a turn (queued or running;
        its client gets `409 interrupted`/`cancelled`). `True` when the server accepted
        it, `False` on `404` (no such turn)."""
        return _cancelled(self._request("DELETE", _turn_path(key, turn_id)))

    def stream(self, key: str, last_event_id: str | None = None) -> EventStream:
        """`GET /v1/sessions/{key}/stream`: an iterator of `Event`s that reconnects by
        itself (see `EventStream`). Close it (or use it as a context manager) when done."""
        check_key(key)
        plan = StreamPlan(self.nodes, self.options, last_event_id)
        return EventStream(
            self._http,
            f"/v1/sessions/{key}/stream",
            plan,
            self._stream_timeout,
            self.options.headers,
        )


class EventStream(Iterator[Event]):
    """A session's events, following it across nodes.

    On `event: reconnect` (the node is draining) or a dropped connection it reconnects to
    the next base URL with `Last-Event-ID` (the id of the last event yielded), so nothing
    is missed or repeated while the server still buffers it. `503` refusals are honoured
    as directives; after `reconnect_budget` without a connection it raises `Unreachable`.

    Control events have `id=None`: `idle` (no owner right now) and `overflow` (this reader
    fell behind the server's buffer). An `overflow` is yielded as a typed event — its
    `data` has `missed` and `last_event_id` — and then the stream resumes by itself from
    `Last-Event-ID`: events still in the server's replay buffer are delivered, anything
    older than that buffer is lost, which the `overflow` event tells the reader.
    """

    def __init__(
        self,
        http: httpx.Client,
        path: str,
        plan: StreamPlan,
        timeout: httpx.Timeout,
        headers: Mapping[str, str],
    ) -> None:
        self._http = http
        self._headers = dict(headers)
        self._path = path
        self._plan = plan
        self._timeout = timeout
        self._events = self._run()

    @property
    def last_event_id(self) -> str | None:
        return self._plan.last_event_id

    @property
    def connections(self) -> list[tuple[str, str | None]]:
        """Every connection made so far: (base URL, the Last-Event-ID it sent)."""
        return list(self._plan.connections)

    def __next__(self) -> Event:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> Generator[Event, None, None]:
        plan = self._plan
        while True:
            url = plan.base_url + self._path
            delay = 0.0
            try:
                with self._http.stream(
                    "GET",
                    url,
                    headers={**self._headers, **plan.request_headers()},
                    timeout=self._timeout,
                ) as response:
                    if response.status_code != 200:
                        content = response.read()
                        delay = plan.refused(response.status_code, _headers(response), content)
                    else:
                        plan.connected()
                        parser = SSEParser()
                        reconnect = False
                        for text in response.iter_text():
                            for frame in parser.feed(text):
                                event, reconnect = plan.frame(frame)
                                if event is not None:
                                    yield event
                                if reconnect:
                                    break
                            if reconnect:
                                break
                        if not reconnect:
                            delay = plan.dropped()
            except _NOT_SENT as e:
                delay = plan.connect_failed(e)
            except _STREAM_DROPPED:
                delay = plan.dropped()
            if delay:
                time.sleep(delay)


class AsyncClient:
    """The asyncio twin of `Client` (same arguments; `http_client` is an
    `httpx.AsyncClient`)."""

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        retry_owner_failed: bool = True,
        owner_failed_retries: int = 3,
        owner_failed_delay: float = 0.5,
        owner_failed_budget: float = 30.0,
        retry_after_budget: float = 30.0,
        reconnect_budget: float = 60.0,
        stream_timeout: httpx.Timeout = DEFAULT_STREAM_TIMEOUT,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.nodes = Nodes(base_urls)
        self.options = _options(
            retry_owner_failed,
            owner_failed_retries,
            owner_failed_delay,
            owner_failed_budget,
            retry_after_budget,
            reconnect_budget,
            headers,
        )
        self._stream_timeout = stream_timeout
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=timeout)

    @property
    def base_urls(self) -> list[str]:
        return list(self.nodes.urls)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        owner_failed_retry: bool = False,
    ) -> Answer:
        attempts = Attempts(self.nodes, self.options, owner_failed_retry=owner_failed_retry)
        sent_headers = dict(headers) if headers is not None else dict(self.options.headers)
        while True:
            url = attempts.base_url + path
            try:
                response = await self._http.request(
                    method, url, content=content, headers=sent_headers
                )
            except _NOT_SENT as e:
                attempts.connect_failed(e)
                continue
            except httpx.TransportError as e:
                delay = attempts.connection_lost() if isinstance(e, _LOST) else None
                if delay is None:
                    raise ConnectionLost(f"{method} {url}: {e!r}", url=url) from e
                await asyncio.sleep(delay)
                continue
            outcome = attempts.answered(response.status_code, _headers(response), response.content)
            if isinstance(outcome, Answer):
                return outcome
            await asyncio.sleep(outcome)

    async def send_turn(
        self,
        key: str,
        body: Any,
        *,
        content_type: str | None = None,
        idempotency_key: str | None = None,
        multitask: Multitask | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> TurnResponse:
        """See `Client.send_turn`."""
        path, content, sent, idem = _turn_request(
            key,
            "turns",
            body,
            content_type,
            idempotency_key,
            multitask,
            headers,
            self.options.headers,
        )
        answer = await self._request(
            "POST", path, content=content, headers=sent, owner_failed_retry=True
        )
        return _turn_response(answer, idem)

    async def send_event(
        self,
        key: str,
        body: Any,
        *,
        content_type: str | None = None,
        idempotency_key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> TurnResponse:
        """See `Client.send_event`."""
        path, content, sent, idem = _turn_request(
            key, "events", body, content_type, idempotency_key, None, headers, self.options.headers
        )
        answer = await self._request(
            "POST", path, content=content, headers=sent, owner_failed_retry=True
        )
        return _turn_response(answer, idem)

    async def session(self, key: str) -> SessionInfo:
        """See `Client.session`."""
        return _session_info(await self._request("GET", f"/v1/sessions/{check_key(key)}"))

    async def get_turn(self, key: str, turn_id: str) -> TurnInfo | None:
        """See `Client.get_turn`."""
        return _turn_info(await self._request("GET", _turn_path(key, turn_id)))

    async def turn(self, key: str, turn_id: str) -> TurnInfo | None:
        """The same as `get_turn`."""
        return await self.get_turn(key, turn_id)

    async def cancel_turn(self, key: str, turn_id: str) -> bool:
        """See `Client.cancel_turn`."""
        return _cancelled(await self._request("DELETE", _turn_path(key, turn_id)))

    def stream(self, key: str, last_event_id: str | None = None) -> AsyncEventStream:
        """See `Client.stream`; iterate with `async for`, close with `aclose()`."""
        check_key(key)
        plan = StreamPlan(self.nodes, self.options, last_event_id)
        return AsyncEventStream(
            self._http,
            f"/v1/sessions/{key}/stream",
            plan,
            self._stream_timeout,
            self.options.headers,
        )


class AsyncEventStream(AsyncIterator[Event]):
    """The asyncio twin of `EventStream`."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        path: str,
        plan: StreamPlan,
        timeout: httpx.Timeout,
        headers: Mapping[str, str],
    ) -> None:
        self._http = http
        self._headers = dict(headers)
        self._path = path
        self._plan = plan
        self._timeout = timeout
        self._events = self._run()

    @property
    def last_event_id(self) -> str | None:
        return self._plan.last_event_id

    @property
    def connections(self) -> list[tuple[str, str | None]]:
        return list(self._plan.connections)

    async def __anext__(self) -> Event:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[Event, None]:
        plan = self._plan
        while True:
            url = plan.base_url + self._path
            delay = 0.0
            try:
                async with self._http.stream(
                    "GET",
                    url,
                    headers={**self._headers, **plan.request_headers()},
                    timeout=self._timeout,
                ) as response:
                    if response.status_code != 200:
                        content = await response.aread()
                        delay = plan.refused(response.status_code, _headers(response), content)
                    else:
                        plan.connected()
                        parser = SSEParser()
                        reconnect = False
                        async for text in response.aiter_text():
                            for frame in parser.feed(text):
                                event, reconnect = plan.frame(frame)
                                if event is not None:
                                    yield event
                                if reconnect:
                                    break
                            if reconnect:
                                break
                        if not reconnect:
                            delay = plan.dropped()
            except _NOT_SENT as e:
                delay = plan.connect_failed(e)
            except _STREAM_DROPPED:
                delay = plan.dropped()
            if delay:
                await asyncio.sleep(delay)
