"""Send turns to a session while watching its events, with `leasehold.AsyncClient`.

    python examples/client.py http://127.0.0.1:8080,http://127.0.0.2:8080 chat-7 hello "and again"

The base URLs are every node's public URL (or one load balancer's).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import leasehold


async def watch(client: leasehold.AsyncClient, key: str) -> None:
    """Print the session's events as they come, from whichever node serves the stream."""
    async with client.stream(key) as events:
        async for event in events:
            if event.type == "overflow":  # we fell behind; the stream resumes by itself
                print(f"  (missed {event.data['missed']} events)")
            elif not event.control:  # `idle` is the other control event: no owner now
                print(f"  event {event.id} {event.type} {event.data}")


async def send(client: leasehold.AsyncClient, key: str, text: str) -> None:
    try:
        answer = await client.send_turn(key, {"text": text})
    except leasehold.RetryBudgetExhausted as e:
        # Refused with directives until their budget ran out: the turn did not run.
        print(f"{text!r}: not run, gave up after {e.directives} (last: {e.code})")
    except (leasehold.OwnerFailed, leasehold.ConnectionLost) as e:
        # The turn may have run. The client re-sent it with the same Idempotency-Key (the
        # server runs a key once) 3 times at most, then gave up.
        print(f"{text!r}: may have run ({e.code})")
    except leasehold.Unreachable as e:
        print(f"{text!r}: no node accepted a connection: {e.urls}")
    except leasehold.HttpError as e:
        # Any other non-2xx answer, e.g. the agent's own 400.
        print(f"{text!r}: HTTP {e.status} {e.code}")
    else:
        retried = f" after {answer.directives}" if answer.directives else ""
        retried += " (a replay of its recorded answer)" if answer.replayed else ""
        print(f"{text!r}: ran on {answer.owner} at epoch {answer.epoch}{retried}: {answer.json()}")


async def main(urls: list[str], key: str, texts: list[str]) -> None:
    async with leasehold.AsyncClient(urls) as client:
        watcher = asyncio.create_task(watch(client, key))
        for text in texts:
            await send(client, key, text)
        await asyncio.sleep(0.5)  # let the last events arrive
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        info = await client.session(key)  # a read: never claims the session
        print(f"{key}: owner {info.owner}, epoch {info.epoch}")


if __name__ == "__main__":
    urls = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
    key = sys.argv[2] if len(sys.argv) > 2 else "chat-7"
    asyncio.run(main(urls.split(","), key, sys.argv[3:] or ["hello"]))
