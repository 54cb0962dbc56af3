/**
 * `@leasehold/sdk/langgraph`: a LangGraph checkpointer that stores a graph's
 * checkpoints through the sidecar's fenced checkpoint API.
 *
 * The sidecar keeps ONE opaque blob per session, so the saver keeps the thread's latest
 * `maxCheckpoints` checkpoints (per checkpoint namespace) and their pending writes in
 * that blob, and rewrites it on every `put` / `putWrites` with the epoch of the turn it
 * was made for. The thread is the session: `thread_id` is the session key. A write that
 * the fence refuses throws {@link Fenced}, so a zombie owner can never overwrite the
 * new owner's graph state.
 *
 * ```ts
 * const graph = builder.compile({ checkpointer: LeaseholdSaver.forSession(session) });
 * await graph.invoke(input, { configurable: { thread_id: session.key } });
 * ```
 *
 * `@langchain/langgraph-checkpoint` (and `@langchain/core`) are optional peer
 * dependencies: only this module imports them.
 */

import type { RunnableConfig } from "@langchain/core/runnables";
import {
  BaseCheckpointSaver,
  WRITES_IDX_MAP,
  compareWritesSortKeys,
  copyCheckpoint,
  getCheckpointId,
  writesSortKey,
  type ChannelVersions,
  type Checkpoint,
  type CheckpointListOptions,
  type CheckpointMetadata,
  type CheckpointPendingWrite,
  type CheckpointTuple,
  type PendingWrite,
  type SerializerProtocol,
} from "@langchain/langgraph-checkpoint";

import type { Session } from "./agent.js";
import { Fenced } from "./errors.js";

export { Fenced } from "./errors.js";

/** The blob's format marker; a checkpoint of another shape is never overwritten. */
export const BLOB_FORMAT = "leasehold.langgraph/1";

/** A serialized value: the serializer's type tag and the bytes, base64. */
type Stored = [type: string, base64: string];

interface StoredCheckpoint {
  ns: string;
  id: string;
  parent: string | null;
  checkpoint: Stored;
  metadata: Stored;
}

interface StoredWrite {
  ns: string;
  checkpoint_id: string;
  task_id: string;
  idx: number;
  channel: string;
  value: Stored;
  task_path: string;
}

interface Blob {
  format: typeof BLOB_FORMAT;
  thread_id: string;
  checkpoints: StoredCheckpoint[];
  writes: StoredWrite[];
}

export interface LeaseholdSaverOptions {
  /** Checkpoints kept per namespace (older ones and their writes are dropped). Default 20. */
  maxCheckpoints?: number;
  serde?: SerializerProtocol;
}

/** Where a session's parsed blob is kept between turns at one epoch (`session.memory`). */
const MEMORY_KEY = "leasehold.langgraph.blob";

function encode(bytes: Uint8Array): string {
  return Buffer.from(bytes).toString("base64");
}

function decode(base64: string): Uint8Array {
  return new Uint8Array(Buffer.from(base64, "base64"));
}

function emptyBlob(threadId: string): Blob {
  return { format: BLOB_FORMAT, thread_id: threadId, checkpoints: [], writes: [] };
}

function isBlob(value: unknown): value is Blob {
  if (typeof value !== "object" || value === null) return false;
  const v = value as Partial<Blob>;
  return v.format === BLOB_FORMAT && typeof v.thread_id === "string" && Array.isArray(v.checkpoints) && Array.isArray(v.writes);
}

export class LeaseholdSaver extends BaseCheckpointSaver {
  readonly session: Session;
  readonly maxCheckpoints: number;
  private blob: Blob | undefined;
  private loading: Promise<Blob> | undefined;
  /** Serializes the blob's writes so the last one to land holds every change. */
  private chain: Promise<void> = Promise.resolve();
  private version = 0;
  private written = 0;
  private fenced: Fenced | undefined;

  constructor(session: Session, options: LeaseholdSaverOptions = {}) {
    super(options.serde);
    this.session = session;
    this.maxCheckpoints = Math.max(1, options.maxCheckpoints ?? 20);
  }

  /** A saver for this turn: its writes carry the turn's epoch. */
  static forSession(session: Session, options: LeaseholdSaverOptions = {}): LeaseholdSaver {
    return new LeaseholdSaver(session, options);
  }

  /** `configurable.thread_id` must be the session key (or absent). */
  private threadOf(config: RunnableConfig): string {
    const threadId: unknown = config.configurable?.thread_id;
    if (threadId !== undefined && threadId !== this.session.key) {
      throw new Error(`LeaseholdSaver for session ${this.session.key} cannot serve thread_id ${JSON.stringify(threadId)}: thread_id is the session key`);
    }
    return this.session.key;
  }

  private async load(): Promise<Blob> {
    if (this.blob) return this.blob;
    const held = this.session.memory.get(MEMORY_KEY);
    if (isBlob(held) && held.thread_id === this.session.key) {
      this.blob = held;
      return held;
    }
    this.loading ??= (async () => {
      const thawed = await this.session.thaw();
      let blob: Blob;
      if (thawed === undefined) {
        blob = emptyBlob(this.session.key);
      } else {
        let parsed: unknown;
        try {
          parsed = thawed.json();
        } catch {
          parsed = undefined;
        }
        if (!isBlob(parsed)) {
          throw new Error(`the checkpoint of session ${this.session.key} is not a ${BLOB_FORMAT} blob: refusing to overwrite it`);
        }
        blob = parsed;
      }
      this.blob = blob;
      this.session.memory.set(MEMORY_KEY, blob);
      return blob;
    })();
    try {
      return await this.loading;
    } finally {
      this.loading = undefined;
    }
  }

  /** Write the blob as it is now (coalescing writes queued behind one in flight). */
  private persist(): Promise<void> {
    if (this.fenced) return Promise.reject(this.fenced);
    const wanted = ++this.version;
    const write = this.chain.then(async () => {
      if (this.fenced) throw this.fenced;
      if (this.written >= wanted || !this.blob) return;
      const version = this.version;
      try {
        await this.session.checkpoint(JSON.stringify(this.blob));
        this.written = version;
      } catch (error) {
        // What we hold is ahead of what is stored: the next turn must thaw again.
        this.session.memory.delete(MEMORY_KEY);
        if (error instanceof Fenced) this.fenced = error;
        throw error;
      }
    });
    this.chain = write.catch(() => undefined);
    return write;
  }

  private trim(blob: Blob, ns: string): void {
    const ids = blob.checkpoints
      .filter((c) => c.ns === ns)
      .map((c) => c.id)
      .sort();
    if (ids.length <= this.maxCheckpoints) return;
    const dropped = new Set(ids.slice(0, ids.length - this.maxCheckpoints));
    blob.checkpoints = blob.checkpoints.filter((c) => c.ns !== ns || !dropped.has(c.id));
    blob.writes = blob.writes.filter((w) => w.ns !== ns || !dropped.has(w.checkpoint_id));
  }

  private async tuple(blob: Blob, stored: StoredCheckpoint): Promise<CheckpointTuple> {
    const [checkpoint, metadata] = await Promise.all([
      this.serde.loadsTyped(stored.checkpoint[0], decode(stored.checkpoint[1])) as Promise<Checkpoint>,
      this.serde.loadsTyped(stored.metadata[0], decode(stored.metadata[1])) as Promise<CheckpointMetadata>,
    ]);
    const writes = blob.writes
      .filter((w) => w.ns === stored.ns && w.checkpoint_id === stored.id)
      .map((w) => ({ w, key: writesSortKey(w.task_path, w.task_id, w.idx) }))
      .sort((x, y) => compareWritesSortKeys(x.key, y.key));
    const pendingWrites: CheckpointPendingWrite[] = await Promise.all(
      writes.map(async ({ w }) => [w.task_id, w.channel, (await this.serde.loadsTyped(w.value[0], decode(w.value[1]))) as unknown] as CheckpointPendingWrite),
    );
    const result: CheckpointTuple = {
      config: { configurable: { thread_id: blob.thread_id, checkpoint_ns: stored.ns, checkpoint_id: stored.id } },
      checkpoint,
      metadata,
      pendingWrites,
    };
    if (stored.parent !== null) {
      result.parentConfig = { configurable: { thread_id: blob.thread_id, checkpoint_ns: stored.ns, checkpoint_id: stored.parent } };
    }
    return result;
  }

  override async getTuple(config: RunnableConfig): Promise<CheckpointTuple | undefined> {
    this.threadOf(config);
    const ns = (config.configurable?.checkpoint_ns as string | undefined) ?? "";
    const id = getCheckpointId(config);
    const blob = await this.load();
    const candidates = blob.checkpoints.filter((c) => c.ns === ns && (!id || c.id === id));
    const stored = candidates.sort((x, y) => (x.id < y.id ? 1 : x.id > y.id ? -1 : 0))[0];
    return stored === undefined ? undefined : this.tuple(blob, stored);
  }

  override async *list(config: RunnableConfig, options: CheckpointListOptions = {}): AsyncGenerator<CheckpointTuple> {
    const threadId: unknown = config.configurable?.thread_id;
    if (threadId !== undefined && threadId !== this.session.key) return; // not this session's thread
    const ns = config.configurable?.checkpoint_ns as string | undefined;
    const id = config.configurable?.checkpoint_id as string | undefined;
    const before = options.before?.configurable?.checkpoint_id as string | undefined;
    const { filter } = options;
    let limit = options.limit;
    const blob = await this.load();
    const sorted = blob.checkpoints
      .filter((c) => (ns === undefined || c.ns === ns) && (!id || c.id === id) && (!before || c.id < before))
      .sort((x, y) => (x.id < y.id ? 1 : x.id > y.id ? -1 : 0));
    for (const stored of sorted) {
      if (limit !== undefined && limit <= 0) break;
      const tuple = await this.tuple(blob, stored);
      const metadata = (tuple.metadata ?? {}) as Record<string, unknown>;
      if (filter && !Object.entries(filter).every(([k, v]) => metadata[k] === v)) continue;
      if (limit !== undefined) limit -= 1;
      yield tuple;
    }
  }

  override async put(config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata, _newVersions: ChannelVersions): Promise<RunnableConfig> {
    const threadId = this.threadOf(config);
    this.session.throwIfFenced();
    const ns = (config.configurable?.checkpoint_ns as string | undefined) ?? "";
    const parent = (config.configurable?.checkpoint_id as string | undefined) ?? null;
    const [[cType, cBytes], [mType, mBytes]] = await Promise.all([this.serde.dumpsTyped(copyCheckpoint(checkpoint)), this.serde.dumpsTyped(metadata)]);
    const blob = await this.load();
    blob.checkpoints = blob.checkpoints.filter((c) => !(c.ns === ns && c.id === checkpoint.id));
    blob.checkpoints.push({ ns, id: checkpoint.id, parent, checkpoint: [cType, encode(cBytes)], metadata: [mType, encode(mBytes)] });
    this.trim(blob, ns);
    await this.persist();
    return { configurable: { thread_id: threadId, checkpoint_ns: ns, checkpoint_id: checkpoint.id } };
  }

  override async putWrites(config: RunnableConfig, writes: PendingWrite[], taskId: string, taskPath?: string): Promise<void> {
    this.threadOf(config);
    this.session.throwIfFenced();
    const ns = (config.configurable?.checkpoint_ns as string | undefined) ?? "";
    const checkpointId = config.configurable?.checkpoint_id as string | undefined;
    if (checkpointId === undefined) throw new Error('putWrites: the config has no "checkpoint_id"');
    const serialized = await Promise.all(writes.map(async ([channel, value]) => ({ channel, value: await this.serde.dumpsTyped(value) })));
    const blob = await this.load();
    serialized.forEach(({ channel, value: [type, bytes] }, i) => {
      const idx = WRITES_IDX_MAP[channel] ?? i;
      const at = blob.writes.findIndex((w) => w.ns === ns && w.checkpoint_id === checkpointId && w.task_id === taskId && w.idx === idx);
      // Like the reference savers: a regular write is stored once; special ones (idx < 0) replace.
      if (at >= 0 && idx >= 0) return;
      const entry: StoredWrite = { ns, checkpoint_id: checkpointId, task_id: taskId, idx, channel, value: [type, encode(bytes)], task_path: taskPath ?? "" };
      if (at >= 0) blob.writes[at] = entry;
      else blob.writes.push(entry);
    });
    await this.persist();
  }

  override async deleteThread(threadId: string): Promise<void> {
    if (threadId !== this.session.key) {
      throw new Error(`LeaseholdSaver for session ${this.session.key} cannot delete thread ${threadId}`);
    }
    this.session.throwIfFenced();
    this.blob = emptyBlob(this.session.key);
    this.session.memory.set(MEMORY_KEY, this.blob);
    await this.persist();
  }
}

export interface PublishGraphOptions {
  /** The event type of each chunk. Default `"graph"`. */
  type?: string | ((chunk: unknown) => string);
}

/**
 * Publish every chunk of a graph's stream to the session's observers (through the
 * fence: a fenced publish throws `Fenced`), yielding the chunks on:
 *
 * ```ts
 * for await (const chunk of publishGraphStream(session, await graph.stream(input, config))) { ... }
 * ```
 */
export async function* publishGraphStream<T>(session: Session, stream: AsyncIterable<T>, options: PublishGraphOptions = {}): AsyncGenerator<T> {
  const type = options.type ?? "graph";
  for await (const chunk of stream) {
    await session.publish(typeof type === "function" ? type(chunk) : type, chunk);
    yield chunk;
  }
}
