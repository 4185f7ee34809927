import { ANY, NO_STREAM, STREAM_EXISTS, type AppendExpectedRevision, type Position as EsdbPosition } from '@eventstore/db-client';
import {
  formatPosition,
  matchesFilter,
  parsePositionPair,
  type EventFilter,
  type EventMetadata,
  type ExpectedRevision,
  type JsonValue,
  type Position,
  type RecordedEvent,
} from '../../domain/event-store.port.js';

/**
 * Reads a client stream to its end. Leaving a `for await` early would leave
 * the gRPC call unconsumed, and `client.dispose()` then waits for it forever.
 */
export async function drain<T>(readable: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const item of readable) out.push(item);
  return out;
}

export function toEsdbExpected(expected: ExpectedRevision): AppendExpectedRevision {
  switch (expected) {
    case 'no_stream':
      return NO_STREAM;
    case 'stream_exists':
      return STREAM_EXISTS;
    case 'any':
      return ANY;
    default:
      return expected;
  }
}

/** EventStoreDB's own convention for correlation and causation (`$correlationId`, `$causationId`), then ours. */
export function toEsdbMetadata(metadata: EventMetadata | undefined): Record<string, string> {
  const out: Record<string, string> = {};
  if (!metadata) return out;
  if (metadata.correlationId !== undefined) out.$correlationId = metadata.correlationId;
  if (metadata.causationId !== undefined) out.$causationId = metadata.causationId;
  if (metadata.tenantId !== undefined) out.tenantId = metadata.tenantId;
  if (metadata.actor !== undefined) out.actor = metadata.actor;
  if (metadata.recordedAt !== undefined) out.recordedAt = metadata.recordedAt;
  return out;
}

export function fromEsdbMetadata(raw: unknown): EventMetadata {
  if (raw === null || typeof raw !== 'object' || raw instanceof Uint8Array) return {};
  const m = raw as Record<string, unknown>;
  const str = (v: unknown): string | undefined => (typeof v === 'string' ? v : undefined);
  const out: { -readonly [K in keyof EventMetadata]: EventMetadata[K] } = {};
  const correlationId = str(m.$correlationId) ?? str(m.correlationId);
  const causationId = str(m.$causationId) ?? str(m.causationId);
  if (correlationId !== undefined) out.correlationId = correlationId;
  if (causationId !== undefined) out.causationId = causationId;
  if (str(m.tenantId) !== undefined) out.tenantId = str(m.tenantId);
  if (str(m.actor) !== undefined) out.actor = str(m.actor);
  if (str(m.recordedAt) !== undefined) out.recordedAt = str(m.recordedAt);
  return out;
}

export interface AnyRecorded {
  readonly event?:
    | {
        readonly id: string;
        readonly streamId: string;
        readonly type: string;
        readonly revision: bigint;
        readonly data: unknown;
        readonly metadata?: unknown;
        readonly created: Date;
        readonly position?: EsdbPosition | undefined;
      }
    | undefined;
}

export function toRecorded(resolved: AnyRecorded): RecordedEvent | undefined {
  const e = resolved.event;
  if (!e) return undefined;
  const position = e.position;
  if (!position) return undefined;
  let data: JsonValue;
  if (e.data instanceof Uint8Array) {
    // Not written by this adapter (binary): hand it over as base64 rather than guess.
    data = Buffer.from(e.data).toString('base64');
  } else {
    data = e.data as JsonValue;
  }
  return {
    id: e.id.toLowerCase(),
    streamId: e.streamId,
    type: e.type,
    revision: e.revision,
    position: formatPosition(position.commit, position.prepare),
    data,
    metadata: fromEsdbMetadata(e.metadata),
    created: e.created,
  };
}

export function toEsdbPosition(value: Position): EsdbPosition {
  const { high, low } = parsePositionPair(value);
  return { commit: high, prepare: low };
}

export function comparePos(a: EsdbPosition, b: EsdbPosition): number {
  if (a.commit !== b.commit) return a.commit < b.commit ? -1 : 1;
  return a.prepare < b.prepare ? -1 : a.prepare > b.prepare ? 1 : 0;
}

export function isWanted(streamId: string, type: string, filter: EventFilter | undefined): boolean {
  return !type.startsWith('$') && !streamId.startsWith('$') && matchesFilter(filter, streamId, type);
}
