import { ValidationError } from '@fleet/agent-protocol';
import {
  EventStoreUnavailableError,
  formatPosition,
  isConnectionError,
  type EventFilter,
  type EventMetadata,
  type JsonValue,
  type Position,
  type RecordedEvent,
} from '../../domain/event-store.port.js';

export { isConnectionError };

export interface AppendRow {
  status: string;
  revision: string | null;
  txid: string | null;
  seq: string | null;
}

export interface EventRow {
  tx: string;
  seq: string;
  stream_id: string;
  revision: string;
  event_id: string;
  type: string;
  data: JsonValue;
  metadata: EventMetadata | null;
  created: Date;
  matched?: boolean;
}

// The text form of txid is aliased `tx`, never `txid`: ORDER BY txid would then sort the text ("999" > "1000").
export const COLUMNS = 'txid::text AS tx, seq, stream_id, revision, event_id, type, data, metadata, created';
export const VISIBLE = 'txid < pg_snapshot_xmin(pg_current_snapshot())';
// matchesFilter (event-store.port.ts) in SQL, so a filtered page needs no data for what it skips: $prefixes and $types are text[]; an empty array means "any".
export const MATCH = (prefixes: string, types: string): string =>
  `((cardinality(${prefixes}::text[]) = 0 OR EXISTS (SELECT 1 FROM unnest(${prefixes}::text[]) p WHERE starts_with(stream_id, p)))
    AND (cardinality(${types}::text[]) = 0 OR type = ANY(${types}::text[])))`;

export function toEvent(row: EventRow): RecordedEvent {
  const metadata = row.metadata !== null && typeof row.metadata === 'object' && !Array.isArray(row.metadata) ? row.metadata : {};
  return {
    id: row.event_id,
    streamId: row.stream_id,
    type: row.type,
    revision: BigInt(row.revision),
    position: formatPosition(BigInt(row.tx), BigInt(row.seq)),
    data: row.data,
    metadata,
    created: row.created,
  };
}

export function positionOf(row: { tx: string; seq: string }): Position {
  return formatPosition(BigInt(row.tx), BigInt(row.seq));
}

export function checkFilter(filter: EventFilter | undefined): { prefixes: string[]; types: string[] } {
  if (filter === undefined) return { prefixes: [], types: [] };
  const list = (value: unknown, path: string): string[] => {
    if (value === undefined) return [];
    if (!Array.isArray(value) || !value.every((v) => typeof v === 'string' && v.length > 0)) {
      throw new ValidationError(
        `filter.${path} must be an array of non-empty strings`,
        [{ path: `filter.${path}`, message: 'array of non-empty strings' }],
        'INVALID_FILTER',
      );
    }
    return [...(value as string[])];
  };
  return { prefixes: list(filter.streamPrefixes, 'streamPrefixes'), types: list(filter.eventTypes, 'eventTypes') };
}

export function unavailable(err: unknown, what: string): unknown {
  if (isConnectionError(err))
    return new EventStoreUnavailableError(`Postgres event store unavailable (${what}): ${(err as Error).message}`, { cause: err });
  return err;
}

export const INT8_MAX = 9_223_372_036_854_775_807n;
export const DIRECTIONS = ['forwards', 'backwards'] as const;

export const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
