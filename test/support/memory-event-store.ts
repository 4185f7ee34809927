import { Observable } from 'rxjs';
import {
  ConcurrencyError,
  formatPosition,
  validateAppend,
  type AppendResult,
  type EventStore,
  type ExpectedRevision,
  type NewEvent,
  type ReadStreamOptions,
  type RecordedEvent,
} from '../../src/domain/event-store.port.js';

/**
 * An event store in memory, for unit tests of command handlers: streams with
 * optimistic concurrency (the same validation and conflict rules as the real
 * adapters, whose conformance suite runs against Postgres), no subscriptions.
 */
export class MemoryEventStore implements EventStore {
  // The port names only the real adapters; this one stands in for Postgres (revisions from 0, conflicts on append).
  readonly name = 'postgres' as const;
  private readonly streams = new Map<string, RecordedEvent[]>();
  private seq = 0n;
  appends = 0;

  append(streamId: string, events: readonly NewEvent[], expected: ExpectedRevision): Promise<AppendResult> {
    const valid = validateAppend(streamId, events, expected);
    const stream = this.streams.get(valid.streamId) ?? [];
    const actual = stream.length === 0 ? 'no_stream' : BigInt(stream.length - 1);
    const ok =
      valid.expected === 'any' ||
      (valid.expected === 'no_stream' && actual === 'no_stream') ||
      (valid.expected === 'stream_exists' && actual !== 'no_stream') ||
      valid.expected === actual;
    if (!ok) return Promise.reject(new ConcurrencyError(valid.streamId, valid.expected, actual));
    for (const e of valid.events) {
      this.seq += 1n;
      stream.push({
        id: e.id,
        streamId: valid.streamId,
        type: e.type,
        revision: BigInt(stream.length),
        position: formatPosition(0n, this.seq),
        data: e.data,
        metadata: e.metadata ?? {},
        created: new Date(),
      });
    }
    this.streams.set(valid.streamId, stream);
    this.appends++;
    const last = stream.at(-1);
    if (!last) return Promise.reject(new Error('append wrote nothing'));
    return Promise.resolve({ nextExpectedRevision: last.revision, position: last.position });
  }

  readStream(streamId: string, options: ReadStreamOptions = {}): Promise<RecordedEvent[]> {
    const from = options.fromRevision ?? 0n;
    return Promise.resolve((this.streams.get(streamId) ?? []).filter((e) => e.revision >= from));
  }

  readAll(): Promise<RecordedEvent[]> {
    return Promise.reject(new Error('MemoryEventStore: readAll is not used by command handlers'));
  }

  subscribeToAll(): Observable<never> {
    return new Observable((s) => {
      s.error(new Error('MemoryEventStore: no subscriptions'));
    });
  }

  headPosition(): Promise<undefined> {
    return Promise.resolve(undefined);
  }

  parsePosition(value: string): string {
    return value;
  }

  ping(): Promise<void> {
    return Promise.resolve();
  }

  close(): Promise<void> {
    return Promise.resolve();
  }
}
