import type { RecordedEvent } from '../domain/event-store.port.js';

/** The part of a pg client a projection needs: one query at a time, inside the runner's transaction. */
export interface Sql {
  // eslint-disable-next-line @typescript-eslint/no-unnecessary-type-parameters -- the caller names the row shape it selected, as pg's own query<R> does
  query<R extends Record<string, unknown> = Record<string, unknown>>(
    text: string,
    params?: unknown[],
  ): Promise<{ rows: R[]; rowCount: number | null }>;
}

export interface Migration {
  readonly id: string;
  readonly sql: string;
}

/**
 * A read model: its schema, how one event changes it, and which tables hold
 * it. `apply` runs inside the runner's transaction together with the new
 * checkpoint, so an event is applied exactly once in effect; it must ignore
 * event types it does not know (every projection sees every event, which is
 * what lets its checkpoint always advance).
 */
export interface Projection {
  readonly name: string;
  readonly migrations: readonly Migration[];
  /** Tables this read model owns, in an order safe to TRUNCATE together; compared row by row by `rebuild --verify`. */
  readonly tables: readonly { readonly name: string; readonly key: readonly string[] }[];
  apply(sql: Sql, event: RecordedEvent): Promise<void>;
  /**
   * Optional: applies a run of events in order with the same end state as
   * `apply` on each, in a few set-based statements. The runner and rebuild
   * use it when present, so a replay is not one round trip per event.
   */
  applyBatch?(sql: Sql, events: readonly RecordedEvent[]): Promise<void>;
}
