import type { Pool, PoolClient } from 'pg';
import { Subscription } from 'rxjs';
import type { Logger } from 'pino';
import type { EventStore, Position, RecordedEvent } from '../domain/event-store.port.js';
import { AppError } from '@fleet/agent-protocol';
import { LiveFeed } from './live-feed.js';
import type { Projection } from './projection.js';

export const CHECKPOINTS_MIGRATION = {
  id: '0001_projection_checkpoints',
  sql: `CREATE TABLE IF NOT EXISTS projection_checkpoints (
          name text PRIMARY KEY,
          position text,
          events_applied bigint NOT NULL DEFAULT 0,
          last_event_at timestamptz,
          updated_at timestamptz NOT NULL DEFAULT now()
        );`,
};

export interface ProjectionStatus {
  readonly name: string;
  readonly running: boolean;
  readonly caughtUp: boolean;
  readonly position: Position | undefined;
  readonly eventsApplied: number;
  /** Seconds between now and the commit time of the newest event not yet applied (0 when caught up). */
  readonly lagSeconds: number;
  readonly lastError: string | undefined;
}

// Catch-up pages: each is one transaction per read model, so its fixed cost (round trips, commit) is paid once per PAGE events.
const PAGE = 4000;
const LIVE_BATCH = 100;

/**
 * Runs projections: each catches up by paging through `readAll` from its
 * stored checkpoint (pull-based, so a replay of millions of events never
 * buffers more than a page), then follows the live subscription. Each batch
 * of events and the new checkpoint commit in ONE transaction, and the
 * checkpoint row is locked and compared first, so two runners (two replicas,
 * or a rebuild racing the live runner) can never apply an event twice.
 */
export class ProjectionRunner {
  private readonly states = new Map<string, RunnerState>();
  private stopped = false;

  constructor(
    private readonly store: EventStore,
    private readonly pool: Pool,
    private readonly projections: readonly Projection[],
    private readonly logger: Logger,
  ) {
    for (const p of projections) {
      this.states.set(p.name, {
        projection: p,
        running: false,
        caughtUp: false,
        position: undefined,
        eventsApplied: 0,
        lastError: undefined,
        oldestPendingAt: undefined,
        sub: undefined,
        waiters: new Set(),
        retryTimer: undefined,
        failures: 0,
      });
    }
  }

  get names(): string[] {
    return this.projections.map((p) => p.name);
  }

  async start(): Promise<void> {
    this.stopped = false;
    await this.catchUpTogether([...this.states.values()]);
  }

  stop(): Promise<void> {
    this.stopped = true;
    for (const s of this.states.values()) {
      s.sub?.unsubscribe();
      s.sub = undefined;
      if (s.retryTimer) clearTimeout(s.retryTimer);
      s.running = false;
      for (const w of s.waiters) w.reject(new Error('projection runner stopped'));
      s.waiters.clear();
    }
    return Promise.resolve();
  }

  /** Read through a call: `stop()` may run while `run` awaits. */
  private isStopped(): boolean {
    return this.stopped;
  }

  status(): ProjectionStatus[] {
    const now = Date.now();
    return [...this.states.values()].map((s) => ({
      name: s.projection.name,
      running: s.running,
      caughtUp: s.caughtUp,
      position: s.position,
      eventsApplied: s.eventsApplied,
      lagSeconds: s.oldestPendingAt ? Math.max(0, (now - s.oldestPendingAt) / 1000) : 0,
      lastError: s.lastError,
    }));
  }

  /** Resolves once every projection has applied `position` (read-your-writes); rejects after `timeoutMs`. */
  async waitFor(position: Position, timeoutMs: number): Promise<void> {
    const pending = [...this.states.values()].filter((s) => !s.position || s.position < position);
    if (pending.length === 0) return;
    await Promise.all(
      pending.map(
        (s) =>
          new Promise<void>((resolve, reject) => {
            const waiter: Waiter = {
              position,
              resolve: () => {
                clearTimeout(timer);
                resolve();
              },
              reject: (err) => {
                clearTimeout(timer);
                reject(err);
              },
            };
            const timer = setTimeout(() => {
              s.waiters.delete(waiter);
              reject(new ReadModelLagError(position, s.projection.name, s.position));
            }, timeoutMs);
            s.waiters.add(waiter);
          }),
      ),
    );
  }

  private async run(s: RunnerState): Promise<void> {
    if (this.stopped) return;
    s.running = true;
    try {
      s.position = await this.loadCheckpoint(s.projection.name);
      // Catch up by pages: each page is one transaction.
      for (;;) {
        if (this.isStopped()) return;
        const page = await this.store.readAll({ after: s.position, maxCount: PAGE });
        const [first] = page;
        if (!first) break;
        s.oldestPendingAt = first.created.getTime();
        await this.applyBatch(s, page);
        if (page.length < PAGE) break;
      }
      this.caughtUpNowFollow(s);
    } catch (err) {
      this.fail(s, err);
    }
  }

  /**
   * The first catch-up of every read model from one reader: each page is read
   * and decoded once (with the next page already on its way) and handed to
   * every read model still behind it, each in its own transaction, all at
   * once. A read model whose batch fails leaves the group and retries alone
   * from its checkpoint (`fail` → `run`); the others go on.
   */
  private async catchUpTogether(group: RunnerState[]): Promise<void> {
    if (this.stopped || group.length === 0) return;
    let behind: RunnerState[] = [];
    for (const s of group) s.running = true;
    try {
      const { rows } = await this.pool.query<{ name: string; position: string | null }>(
        'SELECT name, position FROM projection_checkpoints WHERE name = ANY($1::text[])',
        [group.map((s) => s.projection.name)],
      );
      const stored = new Map(rows.map((r) => [r.name, r.position ?? undefined]));
      for (const s of group) s.position = stored.get(s.projection.name);
      behind = [...group];
    } catch (err) {
      this.failTogether(group, err);
      return;
    }
    const positions = behind.map((s) => s.position);
    const from = positions.includes(undefined)
      ? undefined
      : positions.reduce((min, p) => (p !== undefined && min !== undefined && p < min ? p : min));
    const read = (after: Position | undefined): Promise<RecordedEvent[]> => this.store.readAll({ after, maxCount: PAGE });
    let next: Promise<RecordedEvent[]> | undefined = read(from);
    while (next && behind.length > 0) {
      let page: RecordedEvent[];
      try {
        page = await next;
      } catch (err) {
        this.failTogether(behind, err);
        return;
      }
      if (this.isStopped()) return;
      const last = page.at(-1);
      // Prefetch: Postgres and the wire produce the next page while this one is applied.
      next = page.length === PAGE && last ? read(last.position) : undefined;
      next?.catch(() => undefined);
      if (!last) break;
      const failed = new Set<RunnerState>();
      await Promise.all(
        behind.map(async (s) => {
          const at = s.position;
          const fresh = at === undefined ? page : page.filter((e) => e.position > at);
          const [first] = fresh;
          if (!first) return;
          s.oldestPendingAt = first.created.getTime();
          try {
            await this.applyBatch(s, fresh);
          } catch (err) {
            failed.add(s);
            this.fail(s, err);
          }
        }),
      );
      if (failed.size > 0) behind = behind.filter((s) => !failed.has(s));
    }
    if (this.isStopped()) return;
    this.caughtUpNowFollowTogether(behind);
  }

  private caughtUpNowFollow(s: RunnerState): void {
    this.caughtUpNowFollowTogether([s]);
  }

  private caughtUpNowFollowTogether(group: readonly RunnerState[]): void {
    for (const s of group) {
      s.caughtUp = true;
      s.oldestPendingAt = undefined;
      this.logger.info({ projection: s.projection.name, position: s.position, eventsApplied: s.eventsApplied }, 'projection caught up');
    }
    this.follow(group);
  }

  /**
   * Live: one subscription for the read models caught up together, its events
   * applied in order, a batch per microtask burst, every member's share of a
   * batch in ONE transaction (`applyTogether`). A member that fails leaves the
   * group (its `sub`), retries alone from its checkpoint, and then follows alone.
   * One reader and one transaction per batch, where there was one of each per
   * read model: with ten read models every append cost ~20 reads and ~30
   * statements of bookkeeping, on the same cores and server as the command
   * that appended (docs/benchmarks.md, "Control plane").
   */
  private follow(group: readonly RunnerState[]): void {
    if (group.length === 0) return;
    const members = new Set(group);
    const queue: RecordedEvent[] = [];
    let draining: Promise<void> | undefined;
    const drain = async (): Promise<void> => {
      // The subscription hands over a page's events one by one in one synchronous run: take them all as one batch.
      await Promise.resolve();
      while (queue.length > 0 && !this.stopped && members.size > 0) {
        // Live batches stay small: on the Postgres store every open write transaction holds back what
        // readers may see (xmin), so a long read-model transaction would delay every subscriber.
        const batch = queue.splice(0, LIVE_BATCH);
        await this.applyTogether([...members], batch);
      }
      for (const s of members) s.oldestPendingAt = undefined;
    };
    const positions = group.map((s) => s.position);
    const from = positions.includes(undefined)
      ? undefined
      : positions.reduce((min, p) => (p !== undefined && min !== undefined && p < min ? p : min));
    const shared = LiveFeed.of(this.store).subscribe(from, {
      next: (event) => {
        queue.push(event);
        for (const s of members) s.oldestPendingAt ??= event.created.getTime();
        if (!draining) {
          draining = drain()
            .catch((err: unknown) => {
              this.failTogether([...members], err);
            })
            .finally(() => {
              draining = undefined;
            });
        }
      },
      error: (err: unknown) => {
        this.failTogether([...members], err);
      },
    });
    for (const s of group) {
      s.sub = new Subscription(() => {
        members.delete(s);
        if (members.size === 0) shared.unsubscribe();
      });
    }
  }

  private fail(s: RunnerState, err: unknown): void {
    this.failTogether([s], err);
  }

  /**
   * Stops `group` and restarts it from its checkpoints after a backoff. A
   * group that failed together (its reads of the log: the database went
   * away) restarts together, so it goes on sharing one subscription and one
   * transaction per batch; a read model that could not apply a batch fails
   * alone and then follows alone.
   */
  private failTogether(group: readonly RunnerState[], err: unknown): void {
    if (group.length === 0) return;
    for (const s of group) {
      s.sub?.unsubscribe();
      s.sub = undefined;
      s.running = false;
      s.caughtUp = false;
      s.lastError = err instanceof Error ? err.message : String(err);
    }
    if (this.stopped) return;
    // Backs off to 30 s: an event this code cannot apply fails the same way each time, and the log
    // (and /readyz, which reports the projection down with this error) should say so, not flood.
    let failures = 0;
    for (const s of group) failures = Math.max(failures, ++s.failures);
    const delay = Math.min(30_000, 1000 * 2 ** Math.min(failures - 1, 5));
    this.logger.error(
      { projection: group.map((s) => s.projection.name).join(','), failures, err },
      `projection failed; restarting from its checkpoint in ${delay / 1000}s`,
    );
    const [only] = group;
    const timer = setTimeout(() => void (group.length === 1 && only ? this.run(only) : this.catchUpTogether([...group])), delay);
    timer.unref();
    for (const s of group) s.retryTimer = timer;
  }

  /**
   * A live batch for every member in one transaction: the checkpoint rows are
   * locked together (in name order, so two runners on one database wait for
   * each other rather than deadlock), each member applies the events after its
   * own stored checkpoint, and the new checkpoints commit with them. If any of
   * it fails, nothing is kept and each member retries the batch in its own
   * transaction (`applyBatch`), so only the one that cannot apply it fails.
   */
  private async applyTogether(members: readonly RunnerState[], events: readonly RecordedEvent[]): Promise<void> {
    const [only] = members;
    if (members.length === 1 && only) {
      try {
        await this.applyBatch(only, events);
      } catch (err) {
        this.fail(only, err);
      }
      return;
    }
    let applied: Map<RunnerState, { stored: Position | undefined; fresh: readonly RecordedEvent[] }> | undefined;
    try {
      applied = await this.applyInOneTransaction(members, events);
    } catch (err) {
      this.logger.debug({ err: { message: (err as Error).message } }, 'a shared read-model batch failed; applying it per read model');
    }
    if (!applied) {
      for (const s of members) {
        try {
          await this.applyBatch(s, events);
        } catch (err) {
          this.fail(s, err);
        }
      }
      return;
    }
    for (const [s, { stored, fresh }] of applied) this.advanced(s, fresh.at(-1)?.position ?? stored, fresh.length);
  }

  private async applyInOneTransaction(
    members: readonly RunnerState[],
    events: readonly RecordedEvent[],
  ): Promise<Map<RunnerState, { stored: Position | undefined; fresh: readonly RecordedEvent[] }>> {
    const client = await this.pool.connect();
    try {
      const byName = [...members].sort((a, b) => (a.projection.name < b.projection.name ? -1 : 1));
      const opened = (await client.query(
        `BEGIN; SET LOCAL synchronous_commit = off;
         INSERT INTO projection_checkpoints (name) VALUES ${byName.map((s) => `(${client.escapeLiteral(s.projection.name)})`).join(', ')}
         ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
         RETURNING name, position`,
      )) as unknown as Array<{ rows: Array<{ name: string; position: string | null }> }>;
      const stored = new Map((opened.at(-1)?.rows ?? []).map((r) => [r.name, r.position ?? undefined]));
      const applied = new Map<RunnerState, { stored: Position | undefined; fresh: readonly RecordedEvent[] }>();
      for (const s of byName) {
        const at = stored.get(s.projection.name);
        const fresh = at === undefined ? events : events.filter((e) => e.position > at); // older ones: applied by someone else already
        await this.applyEvents(s, client, fresh);
        applied.set(s, { stored: at, fresh });
      }
      const rows = [...applied]
        .filter(([, { fresh }]) => fresh.length > 0)
        .map(([s, { fresh }]) => {
          const last = fresh.at(-1) as RecordedEvent;
          return `(${client.escapeLiteral(s.projection.name)}, ${client.escapeLiteral(last.position)}, ${fresh.length}, ${client.escapeLiteral(last.created.toISOString())}::timestamptz)`;
        });
      await client.query(
        rows.length > 0
          ? `UPDATE projection_checkpoints c
                SET position = v.position, events_applied = c.events_applied + v.applied, last_event_at = v.at, updated_at = now()
               FROM (VALUES ${rows.join(', ')}) AS v(name, position, applied, at)
              WHERE c.name = v.name;
             COMMIT`
          : 'COMMIT',
      );
      return applied;
    } catch (err) {
      await client.query('ROLLBACK').catch(() => undefined);
      throw err;
    } finally {
      client.release();
    }
  }

  /** Applies `fresh` (already past the stored checkpoint) to one read model inside the caller's transaction. */
  private async applyEvents(s: RunnerState, client: PoolClient, fresh: readonly RecordedEvent[]): Promise<void> {
    if (s.projection.applyBatch) {
      if (fresh.length > 0) await s.projection.applyBatch(client, fresh);
      return;
    }
    for (const event of fresh) {
      try {
        await s.projection.apply(client, event);
      } catch (err) {
        // Name the event: an operator must be able to find the one the read model stopped at.
        throw new Error(
          `${s.projection.name}: applying ${event.type} at ${event.position} (${event.streamId}@${event.revision}) failed: ${(err as Error).message}`,
          { cause: err },
        );
      }
    }
  }

  /** After a commit: the member's position, counters and read-your-writes waiters. */
  private advanced(s: RunnerState, newest: Position | undefined, applied: number): void {
    if (newest !== undefined && (s.position === undefined || newest > s.position)) s.position = newest;
    s.eventsApplied += applied;
    s.lastError = undefined;
    s.failures = 0;
    for (const w of s.waiters) {
      if (s.position !== undefined && s.position >= w.position) {
        s.waiters.delete(w);
        w.resolve();
      }
    }
  }

  private async applyBatch(s: RunnerState, events: readonly RecordedEvent[]): Promise<void> {
    const client = await this.pool.connect();
    try {
      // A read model is derived: a crash may lose its last few commits, which the checkpoint (in the same
      // transaction) then replays; the next durable commit on the server flushes them anyway.
      // One round trip to open and lock, one to checkpoint and commit (simple-query text, so literals):
      // a replay runs thousands of these transactions and each round trip is two syscalls and a wake-up.
      const name = client.escapeLiteral(s.projection.name);
      const opened = (await client.query(
        `BEGIN; SET LOCAL synchronous_commit = off;
         INSERT INTO projection_checkpoints (name) VALUES (${name})
         ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
         RETURNING position`,
      )) as unknown as Array<{ rows: Array<{ position: string | null }> }>;
      const stored = opened.at(-1)?.rows[0]?.position ?? undefined;
      const fresh = stored === undefined ? events : events.filter((e) => e.position > stored); // older ones: applied by someone else already
      await this.applyEvents(s, client, fresh);
      const last: RecordedEvent | undefined = fresh.at(-1);
      await client.query(
        last
          ? `UPDATE projection_checkpoints
                SET position = ${client.escapeLiteral(last.position)}, events_applied = events_applied + ${fresh.length},
                    last_event_at = ${client.escapeLiteral(last.created.toISOString())}, updated_at = now()
              WHERE name = ${name};
             COMMIT`
          : 'COMMIT',
      );
      this.advanced(s, last?.position ?? stored, fresh.length);
    } catch (err) {
      await client.query('ROLLBACK').catch(() => undefined);
      throw err;
    } finally {
      client.release();
    }
  }

  private async loadCheckpoint(name: string): Promise<Position | undefined> {
    const { rows } = await this.pool.query<{ position: string | null }>('SELECT position FROM projection_checkpoints WHERE name = $1', [
      name,
    ]);
    return rows[0]?.position ?? undefined;
  }
}

export class ReadModelLagError extends AppError {
  constructor(position: Position, projection: string, reached: Position | undefined) {
    super(
      'READ_MODEL_LAGGING',
      503,
      `read model ${projection} has not caught up to position ${position} yet (at ${reached ?? 'start'}); retry shortly`,
      { projection },
    );
  }
}

interface Waiter {
  readonly position: Position;
  resolve(): void;
  reject(err: Error): void;
}

interface RunnerState {
  readonly projection: Projection;
  running: boolean;
  caughtUp: boolean;
  position: Position | undefined;
  eventsApplied: number;
  lastError: string | undefined;
  oldestPendingAt: number | undefined;
  sub: Subscription | undefined;
  waiters: Set<Waiter>;
  retryTimer: NodeJS.Timeout | undefined;
  /** Consecutive failures, for the restart backoff. */
  failures: number;
}
