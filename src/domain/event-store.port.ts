import type { Observable } from 'rxjs';
import { AppError, ValidationError } from '@fleet/agent-protocol';

/**
 * The event store port. Two adapters implement it and pass one conformance
 * suite (test/event-store/conformance.ts): Postgres (the embedded default) and
 * EventStoreDB. Revisions are bigint in code and strings on the wire.
 */

/** `no_stream`: the stream must not exist; `stream_exists`: it must; `any`: no check; bigint: its last event's revision must be exactly this. */
export type ExpectedRevision = 'no_stream' | 'stream_exists' | 'any' | bigint;

/**
 * A global position in the log of all events: opaque to callers but sortable
 * as a plain string (fixed-width lowercase hex, see `formatPosition`), so a
 * read model can compare its checkpoint with a command's position in SQL or JS
 * without knowing which adapter produced them. Two adapters never share a log.
 */
export type Position = string;

export interface EventMetadata {
  readonly correlationId?: string | undefined;
  readonly causationId?: string | undefined;
  readonly tenantId?: string | undefined;
  readonly actor?: string | undefined;
  /** ISO-8601 time the command that produced it ran; set by the appender (the clock lives outside the domain). */
  readonly recordedAt?: string | undefined;
}

export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue };

export interface NewEvent {
  /** UUID. Appending an id the stream already holds is idempotent. */
  readonly id: string;
  readonly type: string;
  readonly data: unknown;
  readonly metadata?: EventMetadata | undefined;
}

export interface RecordedEvent {
  readonly id: string;
  readonly streamId: string;
  readonly type: string;
  readonly revision: bigint;
  readonly position: Position;
  readonly data: JsonValue;
  readonly metadata: EventMetadata;
  /** When the store committed it. */
  readonly created: Date;
}

export interface AppendResult {
  /** Revision of the last event now in the stream: the expected revision for the next append. */
  readonly nextExpectedRevision: bigint;
  /** Global position of the last event appended (or, for an idempotent re-append, of the last event already there). */
  readonly position: Position;
}

export type Direction = 'forwards' | 'backwards';

export interface ReadStreamOptions {
  readonly direction?: Direction | undefined;
  /** Inclusive. Default: the start (forwards) or the end (backwards). */
  readonly fromRevision?: bigint | undefined;
  readonly maxCount?: number | undefined;
}

export interface EventFilter {
  /** Stream name prefixes, e.g. `vm-` or `host-`; an event matches if its stream starts with any. */
  readonly streamPrefixes?: readonly string[] | undefined;
  /** Exact event types; an event matches if its type is any of them. */
  readonly eventTypes?: readonly string[] | undefined;
}

export interface ReadAllOptions {
  /** Exclusive: read events after this position. Undefined means from the very start. */
  readonly after?: Position | undefined;
  readonly maxCount?: number | undefined;
  readonly filter?: EventFilter | undefined;
}

export interface SubscribeOptions {
  /** Exclusive: deliver events after this checkpoint. Undefined means from the very start. */
  readonly after?: Position | undefined;
  readonly filter?: EventFilter | undefined;
}

/**
 * What a catch-up subscription emits. `checkpoint` lets a filtered consumer
 * advance its stored position past events it does not care about; `caught-up`
 * is emitted once, when the historical part has been delivered and the
 * subscription goes live.
 */
export type SubscriptionItem =
  | { readonly kind: 'event'; readonly event: RecordedEvent }
  | { readonly kind: 'checkpoint'; readonly position: Position }
  | { readonly kind: 'caught-up'; readonly position: Position | undefined };

export interface EventStore {
  readonly name: 'postgres' | 'esdb';
  append(streamId: string, events: readonly NewEvent[], expected: ExpectedRevision): Promise<AppendResult>;
  /** Events of one stream; an absent stream reads as empty. */
  readStream(streamId: string, options?: ReadStreamOptions): Promise<RecordedEvent[]>;
  /** All events forwards in global order, never skipping one a slower writer commits later. */
  readAll(options?: ReadAllOptions): Promise<RecordedEvent[]>;
  /** Catch up from a checkpoint, then stay live. Unsubscribing stops it. Errors only when it cannot recover. */
  subscribeToAll(options?: SubscribeOptions): Observable<SubscriptionItem>;
  /** Position of the newest event in the log that readers may see, or undefined for an empty log. */
  headPosition(): Promise<Position | undefined>;
  /** Validates an opaque checkpoint string from outside (a query, a header); throws InvalidCheckpointError. */
  parsePosition(value: string): Position;
  /** Resolves when the store answers; throws EventStoreUnavailableError otherwise. */
  ping(): Promise<void>;
  close(): Promise<void>;
}

// ---------------------------------------------------------------- errors

export class ConcurrencyError extends AppError {
  readonly stream: string;
  readonly expected: ExpectedRevision;
  readonly actual: bigint | 'no_stream';
  constructor(stream: string, expected: ExpectedRevision, actual: bigint | 'no_stream') {
    super('CONCURRENCY_CONFLICT', 409, `stream ${stream}: expected revision ${String(expected)}, actual ${String(actual)}`, {
      stream,
      expected: String(expected),
      actual: String(actual),
    });
    this.stream = stream;
    this.expected = expected;
    this.actual = actual;
  }
}

export class InvalidStreamNameError extends ValidationError {
  constructor(stream: unknown, why: string) {
    super(`invalid stream name ${JSON.stringify(stream)}: ${why}`, [{ path: 'stream', message: why }], 'INVALID_STREAM_NAME');
  }
}

export class InvalidEventTypeError extends ValidationError {
  constructor(type: unknown, why: string) {
    super(`invalid event type ${JSON.stringify(type)}: ${why}`, [{ path: 'type', message: why }], 'INVALID_EVENT_TYPE');
  }
}

export class InvalidExpectedRevisionError extends ValidationError {
  constructor(value: unknown) {
    super(
      `invalid expected revision ${safeString(value)}: use 'no_stream', 'stream_exists', 'any' or a non-negative bigint`,
      [{ path: 'expectedRevision', message: 'not one of the four forms' }],
      'INVALID_EXPECTED_REVISION',
    );
  }
}

export class InvalidEventDataError extends ValidationError {
  constructor(path: string, why: string) {
    super(`event data is not JSON-serialisable at ${path}: ${why}`, [{ path, message: why }], 'INVALID_EVENT_DATA');
  }
}

export class InvalidEventIdError extends ValidationError {
  constructor(id: unknown) {
    super(`invalid event id ${safeString(id)}: must be a UUID`, [{ path: 'id', message: 'must be a UUID' }], 'INVALID_EVENT_ID');
  }
}

export class InvalidCheckpointError extends ValidationError {
  constructor(value: unknown, why: string) {
    super(`invalid checkpoint ${safeString(value)}: ${why}`, [{ path: 'checkpoint', message: why }], 'INVALID_CHECKPOINT');
  }
}

export class EventStoreUnavailableError extends AppError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('EVENT_STORE_UNAVAILABLE', 503, message, undefined, options);
  }
}

/**
 * Errors that mean "the database is not there" rather than "this request is
 * wrong", by the driver's code or message (Postgres classes 08 and 57P,
 * socket errors): for the store's adapters, and for a projection runner
 * telling a lost connection from a read model that cannot apply an event.
 */
export function isConnectionError(err: unknown): boolean {
  const e = err as { code?: string; message?: string } | null | undefined;
  if (
    typeof e?.code === 'string' &&
    (/^(08|57P)/.test(e.code) || ['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EPIPE', 'ENOTFOUND', 'EHOSTUNREACH'].includes(e.code))
  )
    return true;
  return (
    typeof e?.message === 'string' &&
    /Connection terminated|connection timeout|Client has encountered a connection error|Cannot use a pool after calling end/i.test(
      e.message,
    )
  );
}

function safeString(value: unknown): string {
  if (typeof value === 'bigint') return `${value}n`;
  try {
    // eslint-disable-next-line @typescript-eslint/no-unnecessary-condition -- undefined for undefined, functions and symbols, whatever lib.d.ts says
    return JSON.stringify(value) ?? String(value);
  } catch {
    return String(value);
  }
}

// ---------------------------------------------------------------- validation shared by every adapter

const STREAM_NAME = /^[a-z][a-z0-9_]*-[A-Za-z0-9][A-Za-z0-9._:@-]*$/;
const EVENT_TYPE = /^[A-Za-z][A-Za-z0-9_.:-]*$/;
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/** Streams are `<category>-<id>` (DESIGN.md): `vm-…`, `host-…`, `snapshot-…`, `tenant-…`, `deadletter-…`. */
export function assertStreamName(stream: unknown): asserts stream is string {
  if (typeof stream !== 'string' || stream.length === 0) throw new InvalidStreamNameError(stream, 'must be a non-empty string');
  if (stream.length > 200) throw new InvalidStreamNameError(stream, 'longer than 200 characters');
  if (!STREAM_NAME.test(stream))
    throw new InvalidStreamNameError(stream, 'must be <category>-<id>: a lowercase category, a dash, then letters, digits or ._:@-');
}

export function assertEventType(type: unknown): asserts type is string {
  if (typeof type !== 'string' || type.length === 0) throw new InvalidEventTypeError(type, 'must be a non-empty string');
  if (type.length > 128) throw new InvalidEventTypeError(type, 'longer than 128 characters');
  if (!EVENT_TYPE.test(type)) throw new InvalidEventTypeError(type, 'must start with a letter and hold only letters, digits or _.:-');
}

export function assertExpectedRevision(value: unknown): asserts value is ExpectedRevision {
  if (value === 'no_stream' || value === 'stream_exists' || value === 'any') return;
  if (typeof value === 'bigint' && value >= 0n) return;
  throw new InvalidExpectedRevisionError(value);
}

/** The category of a stream: the part before the first dash (`vm-123` → `vm`). */
export function streamCategory(stream: string): string {
  const dash = stream.indexOf('-');
  return dash < 0 ? stream : stream.slice(0, dash);
}

/**
 * Checks that `value` round-trips through JSON unchanged (no undefined inside
 * arrays, no bigint, no NaN/Infinity, no functions, symbols, cycles or class
 * instances other than Date) and returns it as a JsonValue. Dates become ISO
 * strings, as JSON.stringify would make them.
 */
export function toJsonValue(value: unknown, path = 'data', seen: Set<object> = new Set()): JsonValue {
  if (value === null) return null;
  switch (typeof value) {
    case 'string':
    case 'boolean':
      return value;
    case 'number':
      if (!Number.isFinite(value)) throw new InvalidEventDataError(path, `${value} is not a JSON number`);
      return value;
    case 'bigint':
      throw new InvalidEventDataError(path, 'bigint is not JSON; send it as a string');
    case 'undefined':
      throw new InvalidEventDataError(path, 'undefined is not JSON');
    case 'function':
    case 'symbol':
      throw new InvalidEventDataError(path, `${typeof value} is not JSON`);
    case 'object':
      break;
  }
  const obj = value;
  if (obj instanceof Date) {
    if (Number.isNaN(obj.getTime())) throw new InvalidEventDataError(path, 'invalid Date');
    return obj.toISOString();
  }
  if (seen.has(obj)) throw new InvalidEventDataError(path, 'circular reference');
  seen.add(obj);
  try {
    if (Array.isArray(obj)) return obj.map((item, i) => toJsonValue(item, `${path}[${i}]`, seen));
    const proto = Object.getPrototypeOf(obj) as unknown;
    if (proto !== Object.prototype && proto !== null)
      throw new InvalidEventDataError(path, 'only plain objects, arrays and Dates are JSON');
    const out: { [key: string]: JsonValue } = {};
    for (const [key, inner] of Object.entries(obj)) {
      if (inner === undefined) continue; // JSON.stringify drops undefined properties; so do we
      out[key] = toJsonValue(inner, `${path}.${key}`, seen);
    }
    return out;
  } finally {
    seen.delete(obj);
  }
}

/** Validates every event of a batch before anything is written; returns the batch with data normalised to JSON. */
export function validateAppend(
  streamId: unknown,
  events: readonly NewEvent[],
  expected: unknown,
): { streamId: string; events: Array<NewEvent & { data: JsonValue }>; expected: ExpectedRevision } {
  assertStreamName(streamId);
  assertExpectedRevision(expected);
  // Checked at run time for JavaScript callers; through `given`, so isArray does not narrow `events` to any[].
  const given: unknown = events;
  if (!Array.isArray(given) || events.length === 0) {
    throw new ValidationError(
      'append needs at least one event',
      [{ path: 'events', message: 'must be a non-empty array' }],
      'INVALID_EVENT_DATA',
    );
  }
  const ids = new Set<string>();
  const out = events.map((event, i) => {
    if (typeof event.id !== 'string' || !UUID.test(event.id)) throw new InvalidEventIdError(event.id);
    if (ids.has(event.id.toLowerCase()))
      throw new ValidationError(
        `event id ${event.id} appears twice in one batch`,
        [{ path: `events[${i}].id`, message: 'duplicate' }],
        'INVALID_EVENT_ID',
      );
    ids.add(event.id.toLowerCase());
    assertEventType(event.type);
    const data = toJsonValue(event.data, `events[${i}].data`);
    if (event.metadata !== undefined) toJsonValue(event.metadata, `events[${i}].metadata`);
    return { ...event, id: event.id.toLowerCase(), data };
  });
  return { streamId, events: out, expected };
}

/** Fixed-width hex pair: sortable as a string, so positions compare without parsing. */
export function formatPosition(high: bigint, low: bigint): Position {
  return `${high.toString(16).padStart(16, '0')}-${low.toString(16).padStart(16, '0')}`;
}

const POSITION = /^[0-9a-f]{16}-[0-9a-f]{16}$/;

export function parsePositionPair(value: unknown): { high: bigint; low: bigint } {
  if (typeof value !== 'string' || !POSITION.test(value)) {
    throw new InvalidCheckpointError(value, 'expected 16 hex digits, a dash, 16 hex digits (as returned by the API)');
  }
  return { high: BigInt(`0x${value.slice(0, 16)}`), low: BigInt(`0x${value.slice(17)}`) };
}

/** A read's maxCount: absent, or a non-negative safe integer; both adapters refuse anything else alike. */
export function checkMaxCount(value: unknown): number | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0) {
    throw new ValidationError(
      // eslint-disable-next-line @typescript-eslint/no-base-to-string -- any value a caller passed, shown as JavaScript prints it
      `maxCount must be a non-negative integer, got ${String(value)}`,
      [{ path: 'maxCount', message: 'not a non-negative integer' }],
      'INVALID_MAX_COUNT',
    );
  }
  return value;
}

export function comparePositions(a: Position, b: Position): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

export function matchesFilter(filter: EventFilter | undefined, streamId: string, type: string): boolean {
  if (!filter) return true;
  if (filter.streamPrefixes && filter.streamPrefixes.length > 0 && !filter.streamPrefixes.some((p) => streamId.startsWith(p))) return false;
  if (filter.eventTypes && filter.eventTypes.length > 0 && !filter.eventTypes.includes(type)) return false;
  return true;
}
