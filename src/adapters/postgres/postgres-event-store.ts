import type { Observable } from 'rxjs';
import type pg from 'pg';
import { ValidationError } from '@fleet/agent-protocol';
import {
  ConcurrencyError,
  EventStoreUnavailableError,
  assertStreamName,
  checkMaxCount,
  parsePositionPair,
  toJsonValue,
  validateAppend,
  type AppendResult,
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
import { eventStoreMigrations } from './event-store.schema.js';
import { NotificationListener } from './notification-listener.js';
import { GroupCommitWriter } from './group-commit-writer.js';
import { PostgresSubscriptions } from './postgres-subscriptions.js';
import { COLUMNS, DIRECTIONS, INT8_MAX, MATCH, VISIBLE, checkFilter, positionOf, toEvent, unavailable, type EventRow } from './pg-rows.js';

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

export class PostgresEventStore implements EventStore {
  readonly name = 'postgres' as const;
  private readonly pool: pg.Pool;
  private readonly logger: Logger | undefined;
  private readonly ownsPool: boolean;
  private readonly listener: NotificationListener;
  private readonly writer: GroupCommitWriter;
  private readonly subscriptions: PostgresSubscriptions;
  private closed = false;

  constructor(options: PostgresEventStoreOptions) {
    this.pool = options.pool;
    this.logger = options.logger;
    const notifyMode = options.notify ?? 'after-commit';
    this.ownsPool = options.ownsPool ?? false;
    this.listener = new NotificationListener(this.pool.options, this.logger);
    const positive = (v: number | undefined, fallback: number, name: string): number => {
      if (v === undefined) return fallback;
      if (!Number.isSafeInteger(v) || v < 1)
        throw new ValidationError(`${name} must be a positive integer`, [{ path: name, message: 'positive integer' }]);
      return v;
    };
    const isClosed = (): boolean => this.closed;
    this.writer = new GroupCommitWriter({
      pool: this.pool,
      logger: this.logger,
      listener: this.listener,
      notifyMode,
      maxFlushAppends: positive(options.maxFlushAppends, 256, 'maxFlushAppends'),
      maxFlushEvents: positive(options.maxFlushEvents, 4096, 'maxFlushEvents'),
      maxFlushBytes: positive(options.maxFlushBytes, 8 * 2 ** 20, 'maxFlushBytes'),
      isClosed,
    });
    this.subscriptions = new PostgresSubscriptions({
      pool: this.pool,
      logger: this.logger,
      listener: this.listener,
      pollIntervalMs: options.pollIntervalMs ?? 500,
      batchSize: options.batchSize ?? 2000,
      giveUpMs: options.subscriptionGiveUpMs ?? 60_000,
      isClosed,
    });
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
    return this.writer.enqueue({ streamId: valid.streamId, expected: valid.expected, expectedText, ids, types, data, metadata, bytes });
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
  subscribeToAll(options: SubscribeOptions = {}): Observable<SubscriptionItem> {
    return this.subscriptions.subscribeToAll(options);
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
    this.subscriptions.closeAll();
    this.listener.release();
    // Appends already queued are answered, not dropped.
    await this.writer.drain();
    if (this.ownsPool) await this.pool.end();
  }
}
