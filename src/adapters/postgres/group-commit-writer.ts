import pg from 'pg';
import { ConflictError } from '@fleet/agent-protocol';
import { ConcurrencyError, EventStoreUnavailableError, type AppendResult, type ExpectedRevision } from '../../domain/event-store.port.js';
import type { Logger } from '../logger.js';
import type { NotificationListener } from './notification-listener.js';
import { EVENTS_CHANNEL } from './event-store.schema.js';
import { isConnectionError, positionOf, sleep, unavailable, type AppendRow } from './pg-rows.js';

/** One append waiting in the writer's queue. */
export interface QueuedAppend {
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

export interface GroupCommitWriterOptions {
  readonly pool: pg.Pool;
  readonly logger: Logger | undefined;
  readonly listener: NotificationListener;
  readonly notifyMode: 'after-commit' | 'in-transaction' | 'off';
  readonly maxFlushAppends: number;
  readonly maxFlushEvents: number;
  readonly maxFlushBytes: number;
  /** The store's closed flag: once set, no more after-commit NOTIFYs. */
  readonly isClosed: () => boolean;
}

/** The store's append path: a queue of appends flushed as group commits, and the NOTIFY after them. */
export class GroupCommitWriter {
  private readonly pool: pg.Pool;
  private readonly logger: Logger | undefined;
  private readonly listener: NotificationListener;
  private readonly notifyMode: 'after-commit' | 'in-transaction' | 'off';
  private readonly isClosed: () => boolean;
  private notifyInFlight = false;
  private notifyPending = false;
  private readonly maxFlushAppends: number;
  private readonly maxFlushEvents: number;
  private readonly maxFlushBytes: number;
  private queue: QueuedAppend[] = [];
  private flushing = false;
  private drained: Array<() => void> = [];

  constructor(options: GroupCommitWriterOptions) {
    this.pool = options.pool;
    this.logger = options.logger;
    this.listener = options.listener;
    this.notifyMode = options.notifyMode;
    this.isClosed = options.isClosed;
    this.maxFlushAppends = options.maxFlushAppends;
    this.maxFlushEvents = options.maxFlushEvents;
    this.maxFlushBytes = options.maxFlushBytes;
  }

  private get closed(): boolean {
    return this.isClosed();
  }

  enqueue(append: Omit<QueuedAppend, 'resolve' | 'reject'>): Promise<AppendResult> {
    return new Promise<AppendResult>((resolve, reject) => {
      this.queue.push({ ...append, resolve, reject });
      this.kick();
    });
  }

  /** Answers the appends already queued, then lets a coalesced NOTIFY in flight finish (before the pool goes). */
  async drain(): Promise<void> {
    while (this.flushing || this.queue.length > 0) await new Promise<void>((r) => this.drained.push(r));
    for (let i = 0; i < 50 && this.notifyInFlight; i++) await sleep(10);
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
}
