"""Typed errors. Every error carries the contract's error code and, for a refusal, its
retry directive (docs/http-api.md), so a caller can tell "not now" from "it may have run".

    LeaseholdError
    ├── HttpError                 a non-success answer (status, code, body)
    │   ├── RetryBudgetExhausted  503 refusals kept coming until the directive's budget ran out
    │   ├── OwnerFailed           502 owner_failed: the turn may have run; no directive
    │   ├── Fenced                409 fenced: this writer no longer owns the session
    │   ├── Busy                  409 busy (multitask `reject`): another turn is running
    │   ├── Interrupted           409 interrupted (multitask `interrupt`): a newer turn won
    │   ├── IdempotencyKeyReused  422: the same Idempotency-Key with another body
    │   └── NotFound              404
    ├── Unreachable               no node accepted a connection (nothing was sent)
    └── ConnectionLost            the connection failed after the request was sent: it may have run
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Directive:
    """A refusal's retry directive: re-send after `delay_ms`, give up `budget_ms` after
    the first attempt."""

    delay_ms: int
    budget_ms: int

    @property
    def delay(self) -> float:
        """The delay in seconds."""
        return self.delay_ms / 1000

    @property
    def budget(self) -> float:
        """The budget in seconds."""
        return self.budget_ms / 1000


class LeaseholdError(Exception):
    """Base of every error this package raises."""

    code: str | None
    directive: Directive | None

    def __init__(
        self, message: str, *, code: str | None = None, directive: Directive | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.directive = directive


class HttpError(LeaseholdError):
    """A non-success answer: its status, the contract's error code (`body["error"]`, when
    the body is such a JSON object), the raw body and the headers."""

    status: int
    body: bytes
    headers: Mapping[str, str]

    def __init__(
        self,
        status: int,
        code: str | None,
        body: bytes,
        *,
        directive: Directive | None = None,
        headers: Mapping[str, str] | None = None,
        message: str | None = None,
    ) -> None:
        text = message or f"HTTP {status}" + (f" {code}" if code else "")
        super().__init__(text, code=code, directive=directive)
        self.status = status
        self.body = body
        self.headers = dict(headers or {})

    def json(self) -> Any:
        """The body as JSON, or `None` when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class RetryBudgetExhausted(HttpError):
    """Refusals with directives kept coming until the last one's budget ran out. `code`
    and `directive` are the last refusal's; `directives` every code obeyed on the way."""

    directives: list[str]

    def __init__(
        self,
        status: int,
        code: str | None,
        body: bytes,
        *,
        directive: Directive | None,
        directives: list[str],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        budget = f" (budget {directive.budget_ms} ms)" if directive else ""
        super().__init__(
            status,
            code,
            body,
            directive=directive,
            headers=headers,
            message=f"gave up after the retry budget{budget}: last refusal {code}",
        )
        self.directives = directives


class OwnerFailed(HttpError):
    """`502 owner_failed`: the owner failed after the turn was sent, so it may have run.
    Never retried unless the client was built with `retry_owner_failed=True`."""


class Fenced(HttpError):
    """`409 fenced`: the writer's epoch is no longer the session's (ownership moved).
    Nothing of the write landed; the turn must stop at once."""

    def __init__(
        self,
        body: bytes = b'{"error":"fenced"}',
        *,
        headers: Mapping[str, str] | None = None,
        message: str | None = None,
    ) -> None:
        super().__init__(409, "fenced", body, headers=headers, message=message or "fenced")


class Busy(HttpError):
    """`409 busy` under the `reject` multitask policy: `turn_id` is the running turn."""

    turn_id: str | None

    def __init__(
        self, body: bytes, turn_id: str | None, *, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(409, "busy", body, headers=headers, message=f"busy with turn {turn_id}")
        self.turn_id = turn_id


class Interrupted(HttpError):
    """`409 interrupted`: a newer turn interrupted this one (multitask `interrupt`)."""


class IdempotencyKeyReused(HttpError):
    """`422 idempotency_key_reused`: the key was used before with another body."""


class NotFound(HttpError):
    """`404`."""


class Unreachable(LeaseholdError):
    """No node accepted a connection: the request was never sent anywhere."""

    def __init__(self, message: str, *, urls: list[str]) -> None:
        super().__init__(message, code="unreachable")
        self.urls = urls


class ConnectionLost(LeaseholdError):
    """The connection failed after the request was (or may have been) sent, or the answer
    did not come in time: the turn may have run. Not retried (like `OwnerFailed`)."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message, code="connection_lost")
        self.url = url
