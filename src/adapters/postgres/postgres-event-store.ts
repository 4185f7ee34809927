import { Observable } from 'rxjs';
import pg from 'pg';
import { ConflictError, ValidationError } from '@fleet/agent-protocol';
import {
  ConcurrencyError,
  EventStoreUnavailableError,
  assertStreamName,
  checkMaxCount,
  formatPosition,
  parsePositionPair,
  toJsonValue,
  validateAppend,
  type AppendResult,
  type EventFilter,
  type EventMetadata,
  type EventStore,
  type ExpectedRevision,
  type JsonValue,
  type NewEvent,
  type Position,
  type ReadAllOptions,
  type ReadStreamOptions,
  type RecordedEvent,
  type SubscribeOptions,
  type SubscriptionItem,
} from '../../domain/event-store.port.js';
import type { Logger } from '../logger.js';
import { createPool } from './pool.js';
import { runMigrations } from './migrations.js';
import { EVENTS_CHANNEL, eventStoreMigrations } from './event-store.schema.js';

export interface PostgresEventStoreOptions {
  readonly pool: pg.Pool;
  readonly logger?: Logger | undefined;
  /** Subscriptions re-read at least this often when no notification arrives. Default 500 ms. */
  readonly pollIntervalMs?: number | undefined;
  /** Rows per catch-up page. Default 2000. */
  readonly batchSize?: number | undefined;
  /**
   * `after-commit` (default): the appender sends one coalesced NOTIFY after its
   * commit. `in-transaction`: the append function NOTIFYs inside the append's
   * transaction. Postgres serialises the commits of every transaction that
   * issued NOTIFY (a database-wide lock held through the WAL flush), which
   * caps concurrent appends at one commit per fsync; see docs/benchmarks.md.
   * `off`: no NOTIFY; other processes' subscriptions find new events by polling.
   * A grouped flush (two appends or more) NOTIFYs inside its transaction unless `off`:
   * one flush is in flight at a time, so there is nothing of ours to serialise.
   */
  readonly notify?: 'after-commit' | 'in-transaction' | 'off' | undefined;
  /** A subscription that cannot read for this long errors with EventStoreUnavailableError. Default 60 s. */
  readonly subscriptionGiveUpMs?: number | undefined;
  /** Whether close() ends the pool. Default false (the caller owns it); `open()` sets it. */
  readonly ownsPool?: boolean | undefined;
  /**
   * Group commit: appends that arrive while a flush is in flight wait for it and
   * go together in the next one (one transaction, each append's outcome its own).
   * A flush carries at most this many appends / events / bytes of event JSON.
   * Defaults 256, 4096, 8 MiB. `maxFlushAppends: 1` turns coalescing off.
   */
  readonly maxFlushAppends?: number | undefined;
  readonly maxFlushEvents?: number | undefined;
  readonly maxFlushBytes?: number | undefined;
}

/** One append waiting in the writer's queue. */
interface QueuedAppend {
  readonly streamId: string;
  readonly expected: ExpectedRevision;
  readonly expectedText: string;
  readonly ids: string[];
  readonly types: string[];
  readonly data: string[];
  readonly metadata: Array<string | null>;
  readonly bytes: number;
  readonly resolve: (result: AppendResult) => void;
  readonly reject: (err: unknown) => void;
}

interface AppendRow {
  status: string;
  revision: string | null;
  txid: string | null;
  seq: string | null;
}

interface EventRow {
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
const COLUMNS = 'txid::text AS tx, seq, stream_id, revision, event_id, type, data, metadata, created';
const VISIBLE = 'txid < pg_snapshot_xmin(pg_current_snapshot())';
// matchesFilter (event-store.port.ts) in SQL, so a filtered page needs no data for what it skips: $prefixes and $types are text[]; an empty array means "any".
const MATCH = (prefixes: string, types: string): string =>
  `((cardinality(${prefixes}::text[]) = 0 OR EXISTS (SELECT 1 FROM unnest(${prefixes}::text[]) p WHERE starts_with(stream_id, p)))
    AND (cardinality(${types}::text[]) = 0 OR type = ANY(${types}::text[])))`;

function toEvent(row: EventRow): RecordedEvent {
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

function positionOf(row: { tx: string; seq: string }): Position {
  return formatPosition(BigInt(row.tx), BigInt(row.seq));
}

function checkFilter(filter: EventFilter | undefined): { prefixes: string[]; types: string[] } {
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

/** Errors that mean "the database is not there" rather than "this request is wrong". */
function isConnectionError(err: unknown): boolean {
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

function unavailable(err: unknown, what: string): unknown {
  if (isConnectionError(err))
    return new EventStoreUnavailableError(`Postgres event store unavailable (${what}): ${(err as Error).message}`, { cause: err });
  return err;
}

const INT8_MAX = 9_223_372_036_854_775_807n;
const DIRECTIONS = ['forwards', 'backwards'] as const;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/**
 * One LISTEN connection shared by every subscription of a store, held only
 * while at least one subscription is live. On loss it reconnects with backoff;
 * meanwhile subscriptions keep polling, and each reconnect wakes them all
 * (a notification sent while we were away is lost, the rows are not).
 */
class NotificationListener {
  private readonly wakers = new Set<() => void>();
  private client: pg.Client | undefined;
  private connecting = false;
  private retryTimer: NodeJS.Timeout | undefined;
  private attempt = 0;
  // Clients we ended on purpose: their 'end' is not a loss to recover from.
  private readonly retired = new WeakSet<pg.Client>();

  constructor(
    private readonly config: pg.ClientConfig,
    private readonly logger: Logger | undefined,
  ) {}

  add(wake: () => void): () => void {
    this.wakers.add(wake);
    if (this.wakers.size === 1) void this.connect();
    return () => {
      this.wakers.delete(wake);
      if (this.wakers.size === 0) this.release();
    };
  }

  wakeAll(): void {
    for (const wake of this.wakers) wake();
  }

  private async connect(): Promise<void> {
    if (this.connecting || this.client || this.wakers.size === 0) return;
    this.connecting = true;
    const client = new pg.Client({ ...this.config, application_name: 'fleet-event-store-listener' });
    let failed = false;
    // `failed` flips in the connection's event handlers while this awaits: read it through a call.
    const hasFailed = (): boolean => failed;
    const onLoss = (err?: Error): void => {
      if (failed || this.retired.has(client)) return;
      failed = true;
      if (this.client === client) this.client = undefined;
      client.removeAllListeners('notification');
      void client.end().catch(() => undefined);
      if (this.wakers.size > 0) {
        this.logger?.warn({ err: err ? { message: err.message } : undefined }, 'event store LISTEN connection lost; reconnecting');
        this.scheduleReconnect();
        this.wakeAll();
      }
    };
    client.on('error', onLoss);
    client.on('end', () => onLoss());
    client.on('notification', () => this.wakeAll());
    try {
      await client.connect();
      await client.query(`LISTEN ${EVENTS_CHANNEL}`);
      this.connecting = false;
      if (hasFailed()) return;
      if (this.wakers.size === 0) {
        failed = true;
        await client.end().catch(() => undefined);
        return;
      }
      this.client = client;
      if (this.attempt > 0) this.wakeAll();
      this.attempt = 0;
    } catch (err) {
      this.connecting = false;
      onLoss(err as Error);
    }
  }

  private scheduleReconnect(): void {
    if (this.retryTimer) return;
    const delay = Math.min(10_000, 100 * 2 ** this.attempt) * (0.5 + Math.random() / 2);
    this.attempt += 1;
    this.retryTimer = setTimeout(() => {
      this.retryTimer = undefined;
      void this.connect();
    }, delay);
    this.retryTimer.unref();
  }

  release(): void {
    if (this.retryTimer) clearTimeout(this.retryTimer);
    this.retryTimer = undefined;
    this.attempt = 0;
    const client = this.client;
    this.client = undefined;
    if (client) {
      this.retired.add(client);
      client.removeAllListeners('notification');
      // Listeners for 'end'/'error' stay: they see wakers empty and do nothing.
      void client.end().catch(() => undefined);
    }
  }
}

export class PostgresEventStore implements EventStore {
  readonly name = 'postgres' as const;
  private readonly pool: pg.Pool;
  private readonly logger: Logger | undefined;
  private readonly pollIntervalMs: number;
  private readonly batchSize: number;
  private readonly notifyMode: 'after-commit' | 'in-transaction' | 'off';
  private readonly giveUpMs: number;
  private readonly ownsPool: boolean;
  private readonly listener: NotificationListener;
  private readonly subscriptions = new Set<() => void>();
  private notifyInFlight = false;
  private notifyPending = false;
  private closed = false;
  private readonly maxFlushAppends: number;
  private readonly maxFlushEvents: number;
  private readonly maxFlushBytes: number;
  private queue: QueuedAppend[] = [];
  private flushing = false;
  private drained: Array<() => void> = [];

  constructor(options: PostgresEventStoreOptions) {
    this.pool = options.pool;
    this.logger = options.logger;
    this.pollIntervalMs = options.pollIntervalMs ?? 500;
    this.batchSize = options.batchSize ?? 2000;
    this.notifyMode = options.notify ?? 'after-commit';
    this.giveUpMs = options.subscriptionGiveUpMs ?? 60_000;
    this.ownsPool = options.ownsPool ?? false;
    this.listener = new NotificationListener(this.pool.options, this.logger);
    const positive = (v: number | undefined, fallback: number, name: string): number => {
      if (v === undefined) return fallback;
      if (!Number.isSafeInteger(v) || v < 1)
        throw new ValidationError(`${name} must be a positive integer`, [{ path: name, message: 'positive integer' }]);
      return v;
    };
    this.maxFlushAppends = positive(options.maxFlushAppends, 256, 'maxFlushAppends');
    this.maxFlushEvents = positive(options.maxFlushEvents, 4096, 'maxFlushEvents');
    this.maxFlushBytes = positive(options.maxFlushBytes, 8 * 2 ** 20, 'maxFlushBytes');
  }

  /** Creates the schema (through runMigrations) on a pool the caller owns. */
  static async migrate(pool: pg.Pool, logger?: Logger): Promise<void> {
    await runMigrations(pool, eventStoreMigrations, { logger });
  }

  /** Opens a pool on `url`, migrates, and returns a store that closes the pool on close(). */
  static async open(
    options: Omit<PostgresEventStoreOptions, 'pool' | 'ownsPool'> & { url: string; poolMax?: number; applicationName?: string },
  ): Promise<PostgresEventStore> {
    const pool = createPool({
      url: options.url,
      max: options.poolMax ?? 10,
      applicationName: options.applicationName ?? 'fleet-event-store',
      logger: options.logger,
    });
    try {
      await PostgresEventStore.migrate(pool, options.logger);
    } catch (err) {
      await pool.end().catch(() => undefined);
      throw unavailable(err, 'migrate');
    }
    return new PostgresEventStore({ ...options, pool, ownsPool: true });
  }

  async append(streamId: string, events: readonly NewEvent[], expected: ExpectedRevision): Promise<AppendResult> {
    const valid = validateAppend(streamId, events, expected);
    const ids: string[] = [];
    const types: string[] = [];
    const data: string[] = [];
    const metadata: Array<string | null> = [];
    valid.events.forEach((e, i) => {
      let meta: JsonValue | undefined;
      // Checked at run time: JavaScript callers pass anything.
      const given: unknown = e.metadata;
      if (given !== undefined && given !== null) {
        if (typeof given !== 'object' || Array.isArray(given)) {
          throw new ValidationError(
            `events[${i}].metadata must be an object`,
            [{ path: `events[${i}].metadata`, message: 'must be an object' }],
            'INVALID_EVENT_DATA',
          );
        }
        meta = toJsonValue(e.metadata, `events[${i}].metadata`);
      }
      ids.push(e.id);
      types.push(e.type);
      data.push(JSON.stringify(e.data));
      metadata.push(meta === undefined ? null : JSON.stringify(meta));
    });
    if (typeof valid.expected === 'bigint' && valid.expected > INT8_MAX) {
      // No stream reaches a revision beyond int8: a conflict, reported with the stream's real revision.
      const [last] = await this.readStream(valid.streamId, { direction: 'backwards', maxCount: 1 });
      throw new ConcurrencyError(valid.streamId, valid.expected, last ? last.revision : 'no_stream');
    }
    const expectedText = typeof valid.expected === 'bigint' ? valid.expected.toString() : valid.expected;
    let bytes = 0;
    for (let i = 0; i < data.length; i++) bytes += (data[i] as string).length + (metadata[i]?.length ?? 0);
    return new Promise<AppendResult>((resolve, reject) => {
      this.queue.push({
        streamId: valid.streamId,
        expected: valid.expected,
        expectedText,
        ids,
        types,
        data,
        metadata,
        bytes,
        resolve,
        reject,
      });
      this.kick();
    });
  }

  /** Starts a flush unless one is in flight: a lone writer goes at once, the rest queue behind it. */
  /** Read through a call: `kick()` may start a flush the compiler cannot see. */
  private isFlushing(): boolean {
    return this.flushing;
  }

  private kick(): void {
    if (this.flushing || this.queue.length === 0) return;
    this.flushing = true;
    const batch = this.takeBatch();
    void this.flush(batch)
      .catch((err: unknown) => {
        for (const a of batch) a.reject(err); // settled ones ignore it
      })
      .finally(() => {
        this.flushing = false;
        this.kick();
        if (!this.isFlushing()) for (const done of this.drained.splice(0)) done();
      });
  }

  /**
   * The next flush, in queue order, within the bounds. An append that shares an
   * event id with an earlier one of its stream in this flush waits for the next
   * (the database decides "already written" against committed rows), and so does
   * everything queued after it on that stream, so a stream's appends keep their order.
   */
  private takeBatch(): QueuedAppend[] {
    const batch: QueuedAppend[] = [];
    const rest: QueuedAppend[] = [];
    const idsByStream = new Map<string, Set<string>>();
    const deferred = new Set<string>();
    let events = 0;
    let bytes = 0;
    for (const a of this.queue) {
      const full =
        batch.length >= this.maxFlushAppends ||
        (batch.length > 0 && (events + a.ids.length > this.maxFlushEvents || bytes + a.bytes > this.maxFlushBytes));
      let ids = idsByStream.get(a.streamId);
      const earlier = ids;
      if (full || deferred.has(a.streamId) || (earlier !== undefined && a.ids.some((id) => earlier.has(id)))) {
        deferred.add(a.streamId);
        rest.push(a);
        continue;
      }
      if (ids === undefined) idsByStream.set(a.streamId, (ids = new Set()));
      for (const id of a.ids) ids.add(id);
      batch.push(a);
      events += a.ids.length;
      bytes += a.bytes;
    }
    this.queue = rest;
    return batch;
  }

  private async flush(batch: QueuedAppend[]): Promise<void> {
    if (batch.length === 1) {
      await this.appendOne(batch[0] as QueuedAppend);
      return;
    }
    let rows: Array<AppendRow & { ord: number }>;
    try {
      rows = await this.appendBatch(batch);
    } catch (err) {
      if (isConnectionError(err)) {
        // The transaction died with the connection: none of it committed, or (the COMMIT
        // sent, its answer lost) all of it did. Either way every append of it learns so.
        const cause = unavailable(err, 'append');
        for (const a of batch) a.reject(cause);
        return;
      }
      // Something in one append broke the whole statement: nothing was written, so give each its own try.
      this.logger?.warn({ err: { message: (err as Error).message }, appends: batch.length }, 'grouped append failed; appending one by one');
      for (const a of batch) await this.appendOne(a);
      return;
    }
    let committed = false;
    for (const a of batch.keys()) {
      const row = rows[a];
      const item = batch[a] as QueuedAppend;
      if (!row || row.ord !== a + 1) {
        item.reject(new EventStoreUnavailableError('es_append_batch returned an unexpected row'));
        continue;
      }
      if (row.status === 'ok') committed = true;
      this.settle(item, row, false);
    }
    // A grouped flush NOTIFYs inside its own transaction (below), so here only local subscriptions need waking.
    if (committed) this.listener.wakeAll();
  }

  private async appendBatch(batch: QueuedAppend[]): Promise<Array<AppendRow & { ord: number }>> {
    const streams: string[] = [];
    const expected: string[] = [];
    const counts: number[] = [];
    const eventAppend: number[] = [];
    const eventPos: number[] = [];
    const ids: string[] = [];
    const types: string[] = [];
    const data: string[] = [];
    const metadata: Array<string | null> = [];
    batch.forEach((a, i) => {
      streams.push(a.streamId);
      expected.push(a.expectedText);
      counts.push(a.ids.length);
      for (let j = 0; j < a.ids.length; j++) {
        eventAppend.push(i + 1);
        eventPos.push(j + 1);
        ids.push(a.ids[j] as string);
        types.push(a.types[j] as string);
        data.push(a.data[j] as string);
        metadata.push(a.metadata[j] ?? null);
      }
    });
    const { rows } = await this.pool.query<AppendRow & { ord: number }>({
      name: 'es_append_batch',
      text: `SELECT ord, status, revision, txid, seq FROM es_append_batch($1::text[], $2::text[], $3::int[], $4::int[], $5::int[], $6::uuid[], $7::text[], $8::text[], $9::text[], $10)`,
      // NOTIFY inside a grouped flush: it serialises commits that NOTIFY, but this writer has one flush in flight
      // at a time, and one more transaction per flush for an after-commit NOTIFY measured costlier (docs/benchmarks.md).
      values: [streams, expected, counts, eventAppend, eventPos, ids, types, data, metadata, this.notifyMode !== 'off'],
    });
    return rows;
  }

  /** One append in its own transaction (es_append): a lone writer's path, and the fallback of a failed flush. */
  private async appendOne(a: QueuedAppend): Promise<void> {
    let row: AppendRow | undefined;
    try {
      const result = await this.pool.query<AppendRow>({
        name: 'es_append',
        text: 'SELECT status, revision, txid, seq FROM es_append($1, $2, $3::uuid[], $4::text[], $5::text[], $6::text[], $7)',
        values: [a.streamId, a.expectedText, a.ids, a.types, a.data, a.metadata, this.notifyMode === 'in-transaction'],
      });
      row = result.rows[0];
    } catch (err) {
      a.reject(unavailable(err, 'append'));
      return;
    }
    if (!row) {
      a.reject(new EventStoreUnavailableError('es_append returned no row'));
      return;
    }
    this.settle(a, row, true);
  }

  private settle(a: QueuedAppend, row: AppendRow, notify: boolean): void {
    const result = (): AppendResult => ({
      nextExpectedRevision: BigInt(row.revision ?? '-1'),
      position: positionOf({ tx: row.txid ?? '0', seq: row.seq ?? '0' }),
    });
    switch (row.status) {
      case 'ok':
        if (notify) this.afterCommit();
        a.resolve(result());
        return;
      case 'idempotent':
        a.resolve(result());
        return;
      case 'conflict':
        a.reject(new ConcurrencyError(a.streamId, a.expected, row.revision === null ? 'no_stream' : BigInt(row.revision)));
        return;
      case 'partial':
        a.reject(
          new ConflictError(
            'EVENT_ID_CONFLICT',
            `stream ${a.streamId}: some of these event ids are already in the stream and some are not; retry with exactly the batch that was written, or with new ids`,
            { stream: a.streamId },
          ),
        );
        return;
      default:
        a.reject(new EventStoreUnavailableError(`append returned unknown status ${row.status}`));
    }
  }

  /** Wake local subscriptions now, and other processes through one coalesced NOTIFY. */
  private afterCommit(): void {
    this.listener.wakeAll();
    if (this.notifyMode !== 'after-commit' || this.closed) return;
    if (this.notifyInFlight) {
      this.notifyPending = true;
      return;
    }
    this.notifyInFlight = true;
    const send = (): void => {
      this.notifyPending = false;
      // A lost wake-up costs one poll interval, so this commit need not wait for the WAL flush.
      this.pool
        .query(`SELECT set_config('synchronous_commit', 'off', true), pg_notify('${EVENTS_CHANNEL}', '')`)
        .catch((err: unknown) =>
          this.logger?.debug({ err: { message: (err as Error).message } }, 'event notification failed; subscribers will poll'),
        )
        .finally(() => {
          if (this.notifyPending && !this.closed) send();
          else this.notifyInFlight = false;
        });
    };
    send();
  }

  async readStream(streamId: string, options: ReadStreamOptions = {}): Promise<RecordedEvent[]> {
    assertStreamName(streamId);
    const direction = options.direction ?? 'forwards';
    // Checked at run time: JavaScript callers pass anything.
    if (!(DIRECTIONS as readonly string[]).includes(direction)) {
      throw new ValidationError(
        `direction must be 'forwards' or 'backwards'`,
        [{ path: 'direction', message: 'forwards | backwards' }],
        'INVALID_DIRECTION',
      );
    }
    const from = options.fromRevision;
    if (from !== undefined && (typeof from !== 'bigint' || from < 0n)) {
      throw new ValidationError(
        `fromRevision must be a non-negative bigint`,
        [{ path: 'fromRevision', message: 'non-negative bigint' }],
        'INVALID_REVISION',
      );
    }
    const maxCount = checkMaxCount(options.maxCount);
    if (maxCount === 0) return [];
    const forwards = direction === 'forwards';
    if (from !== undefined && from > INT8_MAX) {
      if (forwards) return [];
      return this.readStream(streamId, { direction, maxCount });
    }
    const text = `SELECT ${COLUMNS} FROM es_events WHERE stream_id = $1
      ${from === undefined ? '' : forwards ? 'AND revision >= $2' : 'AND revision <= $2'}
      ORDER BY revision ${forwards ? 'ASC' : 'DESC'} ${maxCount === undefined ? '' : `LIMIT ${maxCount}`}`;
    try {
      const { rows } = await this.pool.query<EventRow>(text, from === undefined ? [streamId] : [streamId, from.toString()]);
      return rows.map(toEvent);
    } catch (err) {
      throw unavailable(err, 'readStream');
    }
  }

  async readAll(options: ReadAllOptions = {}): Promise<RecordedEvent[]> {
    const after = options.after === undefined ? undefined : parsePositionPair(options.after);
    const maxCount = checkMaxCount(options.maxCount);
    const { prefixes, types } = checkFilter(options.filter);
    if (maxCount === 0) return [];
    const values: unknown[] = [prefixes, types];
    let where = `${VISIBLE} AND ${MATCH('$1', '$2')}`;
    if (after) {
      values.push(after.high.toString(), after.low.toString());
      where += ' AND (txid, seq) > ($3::text::xid8, $4::bigint)';
    }
    const text = `SELECT ${COLUMNS} FROM es_events WHERE ${where} ORDER BY txid, seq ${maxCount === undefined ? '' : `LIMIT ${maxCount}`}`;
    try {
      const { rows } = await this.pool.query<EventRow>(text, values);
      return rows.map(toEvent);
    } catch (err) {
      throw unavailable(err, 'readAll');
    }
  }

  /**
   * One page of the global log for a subscription: every visible row after the
   * cursor (so the cursor advances past non-matching rows), with data only for
   * the rows that match.
   */
  private async page(
    after: { high: bigint; low: bigint } | undefined,
    prefixes: string[],
    types: string[],
  ): Promise<{ rows: EventRow[]; last: Position | undefined; scanned: number }> {
    const filtered = prefixes.length > 0 || types.length > 0;
    const values: unknown[] = [];
    let where = VISIBLE;
    if (after) {
      values.push(after.high.toString(), after.low.toString());
      where += ' AND (txid, seq) > ($1::text::xid8, $2::bigint)';
    }
    let text: string;
    if (filtered) {
      const p = `$${values.length + 1}`;
      const t = `$${values.length + 2}`;
      values.push(prefixes, types);
      text = `SELECT txid::text AS tx, seq, stream_id, revision, event_id, type,
          CASE WHEN m THEN data END AS data, CASE WHEN m THEN metadata END AS metadata, created, m AS matched
        FROM (SELECT *, ${MATCH(p, t)} AS m FROM es_events WHERE ${where} ORDER BY txid, seq LIMIT ${this.batchSize}) page
        ORDER BY txid, seq`;
    } else {
      text = `SELECT ${COLUMNS} FROM es_events WHERE ${where} ORDER BY txid, seq LIMIT ${this.batchSize}`;
    }
    const { rows } = await this.pool.query<EventRow>(text, values);
    const lastRow = rows[rows.length - 1];
    return { rows: filtered ? rows.filter((r) => r.matched) : rows, last: lastRow ? positionOf(lastRow) : undefined, scanned: rows.length };
  }

  subscribeToAll(options: SubscribeOptions = {}): Observable<SubscriptionItem> {
    return new Observable<SubscriptionItem>((subscriber) => {
      let cursor: { high: bigint; low: bigint } | undefined;
      let filter: { prefixes: string[]; types: string[] };
      try {
        cursor = options.after === undefined ? undefined : parsePositionPair(options.after);
        filter = checkFilter(options.filter);
      } catch (err) {
        subscriber.error(err);
        return undefined;
      }
      if (this.closed) {
        subscriber.error(new EventStoreUnavailableError('event store is closed'));
        return undefined;
      }
      const filtered = filter.prefixes.length > 0 || filter.types.length > 0;
      let stopped = false;
      // `stopped` flips in `stop()` while the loop below awaits: read it through a call, not a narrowed local.
      const isStopped = (): boolean => stopped;
      let dirty = false;
      let wakeUp: (() => void) | undefined;
      const wake = (): void => {
        dirty = true;
        wakeUp?.();
      };
      const stopListening = this.listener.add(wake);
      const stop = (): void => {
        stopped = true;
        stopListening();
        wake();
      };
      const closeFromStore = (): void => {
        stop();
        subscriber.complete();
      };
      this.subscriptions.add(closeFromStore);

      const waitForWork = (ms: number): Promise<void> =>
        new Promise<void>((resolve) => {
          if (dirty || stopped) {
            resolve();
            return;
          }
          const timer = setTimeout(done, ms);
          function done(): void {
            clearTimeout(timer);
            wakeUp = undefined;
            resolve();
          }
          wakeUp = done;
        });

      const run = async (): Promise<void> => {
        let caughtUp = false;
        let failingSince: number | undefined;
        let attempt = 0;
        let position: Position | undefined = options.after;
        type Page = Awaited<ReturnType<PostgresEventStore['page']>>;
        let prefetched: Promise<Page> | undefined;
        while (!stopped) {
          dirty = false;
          let page: Page;
          try {
            const next = prefetched ?? this.page(cursor, filter.prefixes, filter.types);
            prefetched = undefined;
            page = await next;
            failingSince = undefined;
            attempt = 0;
          } catch (err) {
            if (isStopped()) return;
            failingSince ??= Date.now();
            if (Date.now() - failingSince > this.giveUpMs || !isConnectionError(err)) {
              subscriber.error(
                isConnectionError(err)
                  ? new EventStoreUnavailableError(`subscription gave up after ${this.giveUpMs} ms: ${(err as Error).message}`, {
                      cause: err,
                    })
                  : err,
              );
              return;
            }
            this.logger?.warn({ err: { message: (err as Error).message }, attempt }, 'subscription read failed; retrying');
            await waitForWork(Math.min(5_000, 100 * 2 ** attempt++));
            continue;
          }
          if (isStopped()) return;
          // Catching up: ask for the next page before decoding this one, so Postgres and we work at once.
          if (page.scanned === this.batchSize && page.last !== undefined) {
            prefetched = this.page(parsePositionPair(page.last), filter.prefixes, filter.types);
            prefetched.catch(() => undefined); // observed when awaited; this only stops an unhandled-rejection crash
          }
          for (const row of page.rows) {
            if (isStopped()) return;
            subscriber.next({ kind: 'event', event: toEvent(row) });
          }
          if (page.last !== undefined) {
            position = page.last;
            cursor = parsePositionPair(page.last);
            if (filtered && page.rows.length === 0) subscriber.next({ kind: 'checkpoint', position: page.last });
          }
          if (page.scanned < this.batchSize) {
            if (!caughtUp) {
              caughtUp = true;
              subscriber.next({ kind: 'caught-up', position });
            }
            await waitForWork(this.pollIntervalMs);
          } else {
            // Let I/O and the consumer breathe between full pages.
            await new Promise((r) => setImmediate(r));
          }
        }
      };
      void run().catch((err: unknown) => {
        if (!stopped) subscriber.error(err);
      });
      return () => {
        this.subscriptions.delete(closeFromStore);
        stop();
      };
    });
  }

  async headPosition(): Promise<Position | undefined> {
    try {
      const { rows } = await this.pool.query<{ tx: string; seq: string }>(
        `SELECT txid::text AS tx, seq FROM es_events WHERE ${VISIBLE} ORDER BY txid DESC, seq DESC LIMIT 1`,
      );
      const row = rows[0];
      return row ? positionOf(row) : undefined;
    } catch (err) {
      throw unavailable(err, 'headPosition');
    }
  }

  parsePosition(value: string): Position {
    parsePositionPair(value);
    return value;
  }

  async ping(): Promise<void> {
    if (this.closed) throw new EventStoreUnavailableError('event store is closed');
    try {
      await this.pool.query('SELECT 1');
    } catch (err) {
      throw new EventStoreUnavailableError(`Postgres event store unavailable: ${(err as Error).message}`, { cause: err });
    }
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const stop of [...this.subscriptions]) stop();
    this.subscriptions.clear();
    this.listener.release();
    // Appends already queued are answered, not dropped.
    while (this.flushing || this.queue.length > 0) await new Promise<void>((r) => this.drained.push(r));
    // Let a coalesced NOTIFY in flight finish before the pool goes.
    for (let i = 0; i < 50 && this.notifyInFlight; i++) await sleep(10);
    if (this.ownsPool) await this.pool.end();
  }
}
