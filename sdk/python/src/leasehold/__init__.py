"""leasehold: the Python SDK.

- `Client` / `AsyncClient`: the public API (turns, events, streams, session views) with
  retry directives honoured and never invented.
- `leasehold.agent`: an ASGI app for the agent container (docs/http-api.md) and the fenced
  agent API (§5) as a `Session`.
- `leasehold.langgraph`: a LangGraph checkpointer behind the epoch fence.
"""

from .client import AsyncClient, AsyncEventStream, Client, EventStream
from .errors import (
    Busy,
    ConnectionLost,
    Directive,
    Fenced,
    HttpError,
    IdempotencyKeyReused,
    Interrupted,
    LeaseholdError,
    NotFound,
    OwnerFailed,
    RetryBudgetExhausted,
    Unreachable,
)
from .models import Event, SessionInfo, TurnAnswer, TurnInfo, TurnResponse

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncEventStream",
    "Busy",
    "Client",
    "ConnectionLost",
    "Directive",
    "Event",
    "EventStream",
    "Fenced",
    "HttpError",
    "IdempotencyKeyReused",
    "Interrupted",
    "LeaseholdError",
    "NotFound",
    "OwnerFailed",
    "RetryBudgetExhausted",
    "SessionInfo",
    "TurnAnswer",
    "TurnInfo",
    "TurnResponse",
    "Unreachable",
    "__version__",
]
