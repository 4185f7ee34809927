import { Observable } from 'rxjs';
import pg from 'pg';
import {
  EventStoreUnavailableError,
  parsePositionPair,
  type Position,
  type SubscribeOptions,
  type SubscriptionItem,
} from '../../domain/event-store.port.js';
import type { Logger } from '../logger.js';
import type { NotificationListener } from './notification-listener.js';
import { COLUMNS, MATCH, VISIBLE, checkFilter, isConnectionError, positionOf, toEvent, type EventRow } from './pg-rows.js';

export interface PostgresSubscriptionsOptions {
  readonly pool: pg.Pool;
  readonly logger: Logger | undefined;
  readonly listener: NotificationListener;
  readonly pollIntervalMs: number;
  readonly batchSize: number;
  readonly giveUpMs: number;
  /** The store's closed flag: a subscription started after close errors. */
  readonly isClosed: () => boolean;
}

/** subscribeToAll of the Postgres store: catch-up pages of the global log, then LISTEN wake-ups and polling. */
export class PostgresSubscriptions {
  private readonly pool: pg.Pool;
  private readonly logger: Logger | undefined;
  private readonly listener: NotificationListener;
  private readonly pollIntervalMs: number;
  private readonly batchSize: number;
  private readonly giveUpMs: number;
  private readonly isClosed: () => boolean;
  private readonly subscriptions = new Set<() => void>();

  constructor(options: PostgresSubscriptionsOptions) {
    this.pool = options.pool;
    this.logger = options.logger;
    this.listener = options.listener;
    this.pollIntervalMs = options.pollIntervalMs;
    this.batchSize = options.batchSize;
    this.giveUpMs = options.giveUpMs;
    this.isClosed = options.isClosed;
  }

  private get closed(): boolean {
    return this.isClosed();
  }

  /** Completes every live subscription (the store is closing). */
  closeAll(): void {
    for (const stop of [...this.subscriptions]) stop();
    this.subscriptions.clear();
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
        type Page = Awaited<ReturnType<PostgresSubscriptions['page']>>;
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
}
