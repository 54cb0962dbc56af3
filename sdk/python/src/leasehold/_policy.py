"""The client's decisions, shared by the sync and the async client (no I/O here).

A request goes to one node (round robin over the base URLs). A connection refused (or
not made within the connect timeout) never reached the node, so the next node is tried,
as a load balancer would. A `503` carrying a directive is re-sent after `delay_ms` to the
next node, until `budget_ms` after the first attempt. Everything else is the answer:
success is returned, a failure is raised as its typed error. Nothing is retried without a
directive, except a turn or event that may have run (`502 owner_failed`, or its
connection lost after it was sent) while `retry_owner_failed` is on (the default): it is
re-sent with the same Idempotency-Key, at most `owner_failed_retries` times, which the
server answers exactly once (a repeat of a key never runs twice).
"""

from __future__ import annotations

import email.utils
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import (
    Busy,
    Directive,
    Fenced,
    HttpError,
    IdempotencyKeyReused,
    Interrupted,
    NotFound,
    OwnerFailed,
    RetryBudgetExhausted,
    Unreachable,
)
from .models import RECONNECT, Event, event_from_frame
from .sse import Frame

KEY_RE = re.compile(r"[A-Za-z0-9._:@-]{1,200}")
IDEMPOTENCY_KEY_RE = re.compile(r"[\x21-\x7e]{1,255}")
MULTITASK = ("enqueue", "reject", "interrupt")
#: Leasehold-Turn-Id values derived from a caller's non-UUID Idempotency-Key.
TURN_ID_NAMESPACE = uuid.UUID("5b0e3c1e-8d7f-4c1a-9f43-6c8f0a3b9d21")

Multitask = Literal["enqueue", "reject", "interrupt"]


def check_key(key: str) -> str:
    """A session key is 1-200 bytes of `[A-Za-z0-9._:@-]` (docs/http-api.md); `.` and `..` are
    URL dot segments no HTTP client can send as a path segment."""
    if not KEY_RE.fullmatch(key) or key in (".", ".."):
        raise ValueError(f"invalid session key {key!r}: 1-200 characters of [A-Za-z0-9._:@-]")
    return key


def turn_id_for(idempotency_key: str) -> str:
    """The `Leasehold-Turn-Id` sent with every attempt of a turn: the key itself when it
    is a UUID, else a UUID derived from it (today's sidecar accepts only UUID turn ids)."""
    try:
        return str(uuid.UUID(idempotency_key))
    except ValueError:
        return str(uuid.uuid5(TURN_ID_NAMESPACE, idempotency_key))


def encode_body(body: Any, content_type: str | None) -> tuple[bytes, str]:
    """Bytes go as they are, text as UTF-8, anything else as JSON."""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body), content_type or "application/octet-stream"
    if isinstance(body, str):
        return body.encode(), content_type or "text/plain; charset=utf-8"
    encoded = json.dumps(body, separators=(",", ":")).encode()
    return encoded, content_type or "application/json"


def _json_object(content: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(content)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def error_code(content: bytes) -> str | None:
    body = _json_object(content)
    code = body.get("error") if body else None
    return code if isinstance(code, str) else None


def _retry_after_seconds(value: str | None) -> float | None:
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def directive_of(
    status: int, headers: Mapping[str, str], content: bytes, retry_after_budget: float
) -> Directive | None:
    """The retry directive of a `503`: the body's `retry` (exact), else `Retry-After`
    alone (e.g. from a proxy in front), with the client's `retry_after_budget`."""
    if status != 503:
        return None
    body = _json_object(content)
    retry = body.get("retry") if body else None
    if isinstance(retry, dict):
        delay, budget = retry.get("delay_ms"), retry.get("budget_ms")
        if isinstance(delay, int) and isinstance(budget, int) and delay >= 0 and budget >= 0:
            return Directive(delay_ms=delay, budget_ms=budget)
    seconds = _retry_after_seconds(headers.get("retry-after"))
    if seconds is not None:
        return Directive(delay_ms=int(seconds * 1000), budget_ms=int(retry_after_budget * 1000))
    return None


def error_for(
    status: int,
    headers: Mapping[str, str],
    content: bytes,
    directive: Directive | None = None,
) -> HttpError:
    """The typed error of a non-success answer."""
    code = error_code(content)
    if status == 409 and code == "fenced":
        return Fenced(content, headers=headers)
    if status == 409 and code == "busy":
        body = _json_object(content) or {}
        turn_id = body.get("turn_id")
        return Busy(content, turn_id if isinstance(turn_id, str) else None, headers=headers)
    if status == 409 and code == "interrupted":
        return Interrupted(status, code, content, headers=headers)
    if status == 422 and code == "idempotency_key_reused":
        return IdempotencyKeyReused(status, code, content, headers=headers)
    if status == 502 and code == "owner_failed":
        return OwnerFailed(status, code, content, headers=headers)
    if status == 404:
        return NotFound(status, code, content, headers=headers)
    return HttpError(status, code, content, directive=directive, headers=headers)


class Nodes:
    """The base URLs, and a thread-safe round-robin position shared by every request."""

    def __init__(self, base_urls: str | Sequence[str]) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("a client needs at least one base URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.urls)

    def next_index(self) -> int:
        with self._lock:
            return next(self._counter) % len(self.urls)


@dataclass
class Options:
    """Settings shared by `Client` and `AsyncClient` (see their docstrings)."""

    retry_owner_failed: bool = True
    owner_failed_retries: int = 3
    owner_failed_delay: float = 0.5
    owner_failed_budget: float = 30.0
    retry_after_budget: float = 30.0
    reconnect_budget: float = 60.0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """A final answer (after directed retries) and how it was reached."""

    status: int
    headers: Mapping[str, str]
    content: bytes
    url: str
    directives: list[str]


class Attempts:
    """The life of one request: which node to send to next, and what each outcome means.
    Returns a delay (seconds) before the next attempt, or the final `Answer`; raises the
    typed error when there is nothing left to try."""

    def __init__(self, nodes: Nodes, options: Options, *, owner_failed_retry: bool) -> None:
        self.nodes = nodes
        self.options = options
        self.owner_failed_retry = owner_failed_retry and options.retry_owner_failed
        self.started = time.monotonic()
        self.node = nodes.next_index()
        self.refused = 0
        self.resent = 0
        self.directives: list[str] = []

    @property
    def base_url(self) -> str:
        return self.nodes.urls[self.node]

    def _resend(self, code: str) -> float | None:
        """The delay before re-sending a request that may have run (same key), or `None`
        when it may not be re-sent (not asked to, or out of retries or budget)."""
        if not self.owner_failed_retry or self.resent >= self.options.owner_failed_retries:
            return None
        delay = self.options.owner_failed_delay
        if self.elapsed() + delay > self.options.owner_failed_budget:
            return None
        self.resent += 1
        self.directives.append(code)
        self.node = self.nodes.next_index()
        return delay

    def connection_lost(self) -> float | None:
        """The connection failed after the request was sent (reset, closed before the
        answer): the delay before re-sending it with the same key, or `None` to raise."""
        self.refused = 0
        return self._resend("connection_lost")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def connect_failed(self, error: Exception) -> None:
        """Nothing was sent: try the next node, unless every node refused in a row."""
        self.refused += 1
        if self.refused >= len(self.nodes):
            raise Unreachable(
                f"no node accepted a connection ({error})", urls=list(self.nodes.urls)
            ) from error
        self.node = (self.node + 1) % len(self.nodes)

    def answered(self, status: int, headers: Mapping[str, str], content: bytes) -> float | Answer:
        self.refused = 0
        directive = directive_of(status, headers, content, self.options.retry_after_budget)
        if directive is not None:
            code = error_code(content) or "unavailable"
            self.directives.append(code)
            if self.elapsed() + directive.delay > directive.budget:
                raise RetryBudgetExhausted(
                    status,
                    code,
                    content,
                    directive=directive,
                    directives=list(self.directives),
                    headers=headers,
                )
            self.node = self.nodes.next_index()
            return directive.delay
        if status == 502 and error_code(content) == "owner_failed":
            delay = self._resend("owner_failed")
            if delay is not None:
                return delay
        return Answer(status, headers, content, self.base_url, list(self.directives))


class StreamPlan:
    """The life of one event stream: where to (re)connect, with which `Last-Event-ID`,
    and what each frame and failure means."""

    def __init__(self, nodes: Nodes, options: Options, last_event_id: str | None) -> None:
        self.nodes = nodes
        self.options = options
        self.last_event_id = last_event_id
        self.node = nodes.next_index()
        self.failing_since: float | None = None
        self.failures = 0
        self.directives: list[str] = []
        #: Every (re)connection made: (base URL, the Last-Event-ID it sent).
        self.connections: list[tuple[str, str | None]] = []

    @property
    def base_url(self) -> str:
        return self.nodes.urls[self.node]

    def request_headers(self) -> dict[str, str]:
        headers = {"accept": "text/event-stream", "cache-control": "no-cache"}
        if self.last_event_id:
            headers["last-event-id"] = self.last_event_id
        return headers

    def connected(self) -> None:
        self.connections.append((self.base_url, self.last_event_id))
        self.failing_since, self.failures = None, 0

    def _failed(self) -> float:
        """A failed connection: the next node; a pause once every node failed in a row."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        self.failures += 1
        self.node = (self.node + 1) % len(self.nodes)
        return 0.0 if self.failures < len(self.nodes) else min(1.0, 0.1 * self.failures)

    def connect_failed(self, error: Exception) -> float:
        delay = self._failed()
        assert self.failing_since is not None
        if time.monotonic() - self.failing_since + delay > self.options.reconnect_budget:
            raise Unreachable(
                f"no node accepted the stream for {self.options.reconnect_budget} s ({error})",
                urls=list(self.nodes.urls),
            ) from error
        return delay

    def refused(self, status: int, headers: Mapping[str, str], content: bytes) -> float:
        """A non-200 answer to the stream request: a delay, or the typed error."""
        directive = directive_of(status, headers, content, self.options.retry_after_budget)
        if directive is None:
            raise error_for(status, headers, content)
        code = error_code(content) or "unavailable"
        self.directives.append(code)
        self._failed()
        assert self.failing_since is not None
        if time.monotonic() - self.failing_since + directive.delay > directive.budget:
            raise RetryBudgetExhausted(
                status,
                code,
                content,
                directive=directive,
                directives=list(self.directives),
                headers=headers,
            )
        self.node = self.nodes.next_index()
        return directive.delay

    def dropped(self) -> float:
        """The connection ended without `reconnect` (the node died, a proxy cut it)."""
        return self._failed()

    def reconnect(self) -> None:
        """`event: reconnect` (the node drains): straight to the next node."""
        self.node = (self.node + 1) % len(self.nodes)

    def frame(self, frame: Frame) -> tuple[Event | None, bool]:
        """The event to yield (if any) and whether to reconnect after it."""
        if frame.event == RECONNECT and frame.id is None:
            self.reconnect()
            return None, True
        event = event_from_frame(frame.id, frame.event, frame.data)
        if frame.id is not None:
            self.last_event_id = frame.id
        if event.type == "overflow" and frame.id is None:
            # The server closes after it; resume from the last event we have.
            self.reconnect()
            return event, True
        return event, False
