"""A LangGraph checkpointer behind leasehold's epoch fence.

    from leasehold.langgraph import LeaseholdSaver, astream_published

    async def on_turn(session, request):
        saver = LeaseholdSaver.for_session(session)      # one per turn: it carries the epoch
        graph = builder.compile(checkpointer=saver)
        async for _ in astream_published(graph, request.json(), saver.config, session=session):
            pass                                          # every chunk also went to observers
        return (await graph.aget_state(saver.config)).values

The sidecar keeps ONE opaque checkpoint per session, so the saver keeps the thread's
graph checkpoints in that blob: the latest `max_checkpoints` (default 20) per checkpoint
namespace, with their pending writes, as JSON (`{"format": "leasehold.langgraph", ...}`,
values serialised by the saver's `serde` and base64-encoded). `thread_id` is the session
key. Every `aput` / `aput_writes` stores the whole blob through the fenced checkpoint API
with the turn's epoch, so a zombie (a writer whose session moved to another node) gets
`Fenced` on its first graph step and nothing of it lands. The graph run then fails with
`Fenced`, which the agent app answers `409 fenced`.

The blob is read once per saver (per turn) and kept in memory: while this epoch holds the
session nobody else can write it. The saver owns the session's checkpoint: a session whose
checkpoint is something else is refused (`ValueError`) rather than overwritten.

Caveats: pruning to the latest N checkpoints cuts history older than that (time travel,
and the beta `DeltaChannel`, whose reconstruction walks ancestors: use
`max_checkpoints=None` to keep everything). The sync methods (`get_tuple`, `put`, ...)
work only from another thread than the event loop the saver was created on, as
LangGraph's own async savers do; use the async graph API (`ainvoke`, `astream`).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from .agent import Session

FORMAT = "leasehold.langgraph"
VERSION = 1
DEFAULT_MAX_CHECKPOINTS = 20

T = TypeVar("T")

Typed = tuple[str, bytes]


def _enc(value: Typed) -> list[str]:
    return [value[0], base64.b64encode(value[1]).decode("ascii")]


def _dec(value: Any) -> Typed:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise ValueError("malformed serialised value")
    return value[0], base64.b64decode(value[1])


@dataclass
class _Write:
    task_id: str
    idx: int
    channel: str
    value: Typed
    task_path: str


@dataclass
class _Entry:
    id: str
    parent: str | None
    checkpoint: Typed
    metadata: Typed


Writes = dict[tuple[str, int], _Write]


def _ordered(writes: Writes) -> list[_Write]:
    return sorted(writes.values(), key=lambda w: writes_sort_key(w.task_path, w.task_id, w.idx))


@dataclass
class _Doc:
    """The blob: per namespace, checkpoint id → entry, and checkpoint id → its pending
    writes (kept apart: LangGraph may store a step's writes before the checkpoint they
    belong to has been stored)."""

    namespaces: dict[str, dict[str, _Entry]] = field(default_factory=dict)
    writes: dict[str, dict[str, Writes]] = field(default_factory=dict)

    def writes_of(self, ns: str, checkpoint_id: str) -> Writes:
        return self.writes.setdefault(ns, {}).setdefault(checkpoint_id, {})

    def encode(self, thread_id: str) -> bytes:
        namespaces = {
            ns: [
                {
                    "id": e.id,
                    "parent": e.parent,
                    "checkpoint": _enc(e.checkpoint),
                    "metadata": _enc(e.metadata),
                }
                for _, e in sorted(entries.items())
            ]
            for ns, entries in self.namespaces.items()
        }
        writes = {
            ns: {
                checkpoint_id: [
                    [w.task_id, w.idx, w.channel, _enc(w.value), w.task_path] for w in _ordered(ws)
                ]
                for checkpoint_id, ws in sorted(by_id.items())
                if ws
            }
            for ns, by_id in self.writes.items()
        }
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "thread_id": thread_id,
            "namespaces": namespaces,
            "writes": writes,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> _Doc:
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise ValueError(f"the session's checkpoint is not a {FORMAT} blob: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"the session's checkpoint is not a {FORMAT} blob")
        if doc.get("version") != VERSION:
            raise ValueError(f"unsupported {FORMAT} version {doc.get('version')!r}")
        out = cls()
        for ns, entries in doc.get("namespaces", {}).items():
            bucket = out.namespaces.setdefault(ns, {})
            for item in entries:
                entry = _Entry(
                    id=item["id"],
                    parent=item.get("parent"),
                    checkpoint=_dec(item["checkpoint"]),
                    metadata=_dec(item["metadata"]),
                )
                bucket[entry.id] = entry
        for ns, by_id in doc.get("writes", {}).items():
            for checkpoint_id, items in by_id.items():
                writes = out.writes_of(ns, checkpoint_id)
                for task_id, idx, channel, value, task_path in items:
                    writes[(task_id, idx)] = _Write(task_id, idx, channel, _dec(value), task_path)
        return out


class LeaseholdSaver(BaseCheckpointSaver[int]):
    """A `BaseCheckpointSaver` whose storage is the session's fenced checkpoint.

    Create one per turn with `LeaseholdSaver.for_session(session)`: the session carries
    the turn's epoch, which every write is fenced with."""

    def __init__(
        self,
        session: Session,
        *,
        max_checkpoints: int | None = DEFAULT_MAX_CHECKPOINTS,
        serde: SerializerProtocol | None = None,
    ) -> None:
        super().__init__(serde=serde)
        if max_checkpoints is not None and max_checkpoints < 1:
            raise ValueError("max_checkpoints must be at least 1 (or None: keep all)")
        self.session = session
        self.max_checkpoints = max_checkpoints
        self._doc: _Doc | None = None
        self._lock = asyncio.Lock()
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    @classmethod
    def for_session(
        cls,
        session: Session,
        *,
        max_checkpoints: int | None = DEFAULT_MAX_CHECKPOINTS,
        serde: SerializerProtocol | None = None,
    ) -> LeaseholdSaver:
        return cls(session, max_checkpoints=max_checkpoints, serde=serde)

    @property
    def config(self) -> RunnableConfig:
        """The config to run the graph with: `thread_id` is the session key."""
        return {"configurable": {"thread_id": self.session.key}}

    # -- storage ------------------------------------------------------------------------

    def _namespace(self, config: RunnableConfig) -> str:
        configurable = config.get("configurable", {})
        thread_id = configurable.get("thread_id")
        if thread_id is not None and str(thread_id) != self.session.key:
            raise ValueError(
                f"thread_id {thread_id!r} is not this saver's session {self.session.key!r}"
            )
        return str(configurable.get("checkpoint_ns", ""))

    async def _load(self) -> _Doc:
        if self._doc is None:
            data = await self.session.thaw()
            self._doc = _Doc() if data is None else _Doc.decode(data)
        return self._doc

    async def _store(self, doc: _Doc) -> None:
        await self.session.checkpoint(doc.encode(self.session.key))

    def _prune(self, doc: _Doc, ns: str) -> None:
        """Keep the newest `max_checkpoints` of the namespace, and the writes of those
        (and of any newer checkpoint not stored yet)."""
        entries = doc.namespaces.get(ns, {})
        if self.max_checkpoints is None or len(entries) <= self.max_checkpoints:
            return
        for old in sorted(entries)[: len(entries) - self.max_checkpoints]:
            del entries[old]
        oldest = min(entries)
        writes = doc.writes.get(ns, {})
        for checkpoint_id in [c for c in writes if c < oldest]:
            del writes[checkpoint_id]

    def _tuple(self, doc: _Doc, ns: str, entry: _Entry) -> CheckpointTuple:
        thread_id = self.session.key
        parent: RunnableConfig | None = None
        if entry.parent:
            parent = {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": entry.parent,
                }
            }
        return CheckpointTuple(
            config={
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": entry.id,
                }
            },
            checkpoint=self.serde.loads_typed(entry.checkpoint),
            metadata=self.serde.loads_typed(entry.metadata),
            parent_config=parent,
            pending_writes=[
                (w.task_id, w.channel, self.serde.loads_typed(w.value))
                for w in _ordered(doc.writes.get(ns, {}).get(entry.id, {}))
            ],
        )

    # -- the async API ------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        ns = self._namespace(config)
        async with self._lock:
            doc = await self._load()
            entries = doc.namespaces.get(ns, {})
            checkpoint_id = get_checkpoint_id(config)
            if checkpoint_id is None:
                checkpoint_id = max(entries, default=None)
            entry = entries.get(checkpoint_id) if checkpoint_id else None
            return self._tuple(doc, ns, entry) if entry else None

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        for item in await self._list(config, filter=filter, before=before, limit=limit):
            yield item

    async def _list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> list[CheckpointTuple]:
        wanted_ns: str | None = None
        wanted_id: str | None = None
        if config is not None:
            self._namespace(config)
            configurable = config.get("configurable", {})
            wanted_ns = configurable.get("checkpoint_ns")
            wanted_id = get_checkpoint_id(config)
        before_id = get_checkpoint_id(before) if before else None
        out: list[CheckpointTuple] = []
        async with self._lock:
            doc = await self._load()
            for ns, entries in doc.namespaces.items():
                if wanted_ns is not None and ns != wanted_ns:
                    continue
                for checkpoint_id in sorted(entries, reverse=True):
                    if wanted_id and checkpoint_id != wanted_id:
                        continue
                    if before_id and checkpoint_id >= before_id:
                        continue
                    item = self._tuple(doc, ns, entries[checkpoint_id])
                    if filter and not all(item.metadata.get(k) == v for k, v in filter.items()):
                        continue
                    if limit is not None and len(out) >= limit:
                        return out
                    out.append(item)
        return out

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        ns = self._namespace(config)
        entry = _Entry(
            id=checkpoint["id"],
            parent=config.get("configurable", {}).get("checkpoint_id"),
            checkpoint=self.serde.dumps_typed(checkpoint),
            metadata=self.serde.dumps_typed(get_checkpoint_metadata(config, metadata)),
        )
        async with self._lock:
            doc = await self._load()
            doc.namespaces.setdefault(ns, {})[entry.id] = entry
            self._prune(doc, ns)
            await self._store(doc)
        return {
            "configurable": {
                "thread_id": self.session.key,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        ns = self._namespace(config)
        checkpoint_id = config["configurable"]["checkpoint_id"]
        async with self._lock:
            doc = await self._load()
            stored = doc.writes_of(ns, checkpoint_id)
            changed = False
            for idx, (channel, value) in enumerate(writes):
                key = (task_id, WRITES_IDX_MAP.get(channel, idx))
                if key[1] >= 0 and key in stored:
                    continue
                stored[key] = _Write(
                    task_id, key[1], channel, self.serde.dumps_typed(value), task_path
                )
                changed = True
            if changed:
                await self._store(doc)

    async def adelete_thread(self, thread_id: str) -> None:
        if thread_id != self.session.key:
            raise ValueError(f"thread_id {thread_id!r} is not this saver's session")
        async with self._lock:
            self._doc = _Doc()
            await self._store(self._doc)

    # -- the sync API: only from another thread (as LangGraph's async savers) ----------

    def _from_thread(self, coro: Any) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self.loop is None or running is self.loop:
            coro.close()
            raise asyncio.InvalidStateError(
                "LeaseholdSaver's synchronous methods work only from a thread other than its "
                "event loop's: use the async graph API (ainvoke, astream, aget_state)"
            )
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        result: CheckpointTuple | None = self._from_thread(self.aget_tuple(config))
        return result

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        items: list[CheckpointTuple] = self._from_thread(
            self._list(config, filter=filter, before=before, limit=limit)
        )
        return iter(items)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        result: RunnableConfig = self._from_thread(
            self.aput(config, checkpoint, metadata, new_versions)
        )
        return result

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._from_thread(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._from_thread(self.adelete_thread(thread_id))


def _stream_type(mode: Any) -> str:
    return f"graph_{mode}" if isinstance(mode, str) else "graph"


async def astream_published(
    graph: Any,
    graph_input: Any,
    config: RunnableConfig,
    *,
    session: Session,
    stream_mode: str | Sequence[str] = "updates",
    **kwargs: Any,
) -> AsyncIterator[Any]:
    """Run `graph.astream(...)` and publish every chunk to the session's observers
    (event type `graph_<mode>`, e.g. `graph_updates`) before yielding it. Publishing is
    fenced like every write: a zombie's stream stops with `Fenced`."""
    modes = [stream_mode] if isinstance(stream_mode, str) else list(stream_mode)
    several = not isinstance(stream_mode, str)
    async for chunk in graph.astream(graph_input, config, stream_mode=stream_mode, **kwargs):
        if several and isinstance(chunk, tuple) and len(chunk) == 2 and chunk[0] in modes:
            mode, payload = chunk
        else:
            mode, payload = modes[0], chunk
        await session.publish(_stream_type(mode), payload)
        yield chunk
