import type { Pool, PoolClient } from 'pg';
import { Subscription } from 'rxjs';
import type { Logger } from 'pino';
import {
  EventStoreUnavailableError,
  isConnectionError,
  type EventStore,
  type Position,
  type RecordedEvent,
} from '../domain/event-store.port.js';
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
 * The events a live group keeps after applying them, so a read model that
 * caught up on its own (after a failure) can join the group although the
 * group delivered a few events past its position meanwhile.
 */
const RECENT = 1000;
/** The shared live transaction waits this long for a checkpoint row (a rebuild's swap holds one), then falls back to one per read model. */
const SHARED_LOCK_TIMEOUT = '2s';

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
  /** The live group a read model that caught up joins (the one all start in). */
  private live: LiveGroup | undefined;

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
        gen: 0,
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
      s.gen++;
      s.sub?.unsubscribe();
      s.sub = undefined;
      if (s.retryTimer) clearTimeout(s.retryTimer);
      s.running = false;
      for (const w of s.waiters) w.reject(new Error('projection runner stopped'));
      s.waiters.clear();
    }
    this.live = undefined;
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
    // A failure or stop() since this attempt began makes it stale: it then neither follows nor fails.
    const gen = s.gen;
    const current = (): boolean => !this.isStopped() && s.gen === gen;
    s.running = true;
    try {
      const position = await this.loadCheckpoint(s.projection.name);
      if (!current()) return;
      s.position = position;
      // Catch up by pages: each page is one transaction.
      for (;;) {
        const page = await this.store.readAll({ after: s.position, maxCount: PAGE });
        if (!current()) return;
        const [first] = page;
        if (!first) break;
        s.oldestPendingAt = first.created.getTime();
        await this.applyBatch(s, page);
        if (page.length < PAGE) break;
      }
      if (!current()) return;
      this.caughtUpNowFollow(s);
    } catch (err) {
      if (current()) this.fail(s, err);
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
    // Members failed or stopped since this attempt began are no longer its own (see `run`).
    const gens = new Map(group.map((s) => [s, s.gen]));
    const ours = (s: RunnerState): boolean => gens.get(s) === s.gen;
    let behind: RunnerState[] = [];
    for (const s of group) s.running = true;
    try {
      const { rows } = await this.pool.query<{ name: string; position: string | null }>(
        'SELECT name, position FROM projection_checkpoints WHERE name = ANY($1::text[])',
        [group.map((s) => s.projection.name)],
      );
      if (this.isStopped()) return;
      const stored = new Map(rows.map((r) => [r.name, r.position ?? undefined]));
      behind = group.filter(ours);
      for (const s of behind) s.position = stored.get(s.projection.name);
    } catch (err) {
      this.failTogether(group.filter(ours), err);
      return;
    }
    // Every member failed or was restarted while the checkpoints were read: each has a catch-up of its own now.
    if (behind.length === 0) return;
    const positions = behind.map((s) => s.position);
    const from = positions.includes(undefined)
      ? undefined
      : positions.reduce((min, p) => (p !== undefined && min !== undefined && p < min ? p : min), positions[0]);
    const read = (after: Position | undefined): Promise<RecordedEvent[]> => this.store.readAll({ after, maxCount: PAGE });
    let next: Promise<RecordedEvent[]> | undefined = read(from);
    while (next && behind.length > 0) {
      let page: RecordedEvent[];
      try {
        page = await next;
      } catch (err) {
        this.failTogether(behind.filter(ours), err);
        return;
      }
      if (this.isStopped()) return;
      behind = behind.filter(ours);
      const last = page.at(-1);
      // Prefetch: Postgres and the wire produce the next page while this one is applied.
      next = page.length === PAGE && last ? read(last.position) : undefined;
      next?.catch(() => undefined);
      if (!last) break;
      const failed = new Map<RunnerState, unknown>();
      let tried = 0;
      await Promise.all(
        behind.map(async (s) => {
          const at = s.position;
          const fresh = at === undefined ? page : page.filter((e) => e.position > at);
          const [first] = fresh;
          if (!first) return;
          tried++;
          s.oldestPendingAt = first.created.getTime();
          try {
            await this.applyBatch(s, fresh);
          } catch (err) {
            if (ours(s)) failed.set(s, err);
          }
        }),
      );
      if (failed.size > 0) {
        behind = behind.filter((s) => !failed.has(s));
        this.failMembers(failed, failed.size === tried);
      }
    }
    if (this.isStopped()) return;
    this.caughtUpNowFollowTogether(behind.filter(ours));
  }

  private caughtUpNowFollow(s: RunnerState): void {
    this.caughtUpNowFollowTogether([s]);
  }

  private caughtUpNowFollowTogether(group: readonly RunnerState[]): void {
    for (const s of group) {
      s.caughtUp = true;
      s.oldestPendingAt = undefined;
      // The checkpoint may already cover a waiter (a batch committed as its read model was failed).
      this.settleWaiters(s);
      this.logger.info({ projection: s.projection.name, position: s.position, eventsApplied: s.eventsApplied }, 'projection caught up');
    }
    this.follow(group);
  }

  /**
   * Live: one subscription for the read models caught up together, its events
   * applied in order, a batch per microtask burst, every member's share of a
   * batch in ONE transaction (`applyTogether`). A member that fails leaves the
   * group (its `sub`) and retries from its checkpoint; once caught up it joins
   * the runner's live group again (`admit`), so after a failure the read
   * models still share one reader and one transaction per batch. One reader
   * and one transaction per batch, where there was one of each per read
   * model: with ten read models every append cost ~20 reads and ~30
   * statements of bookkeeping, on the same cores and server as the command
   * that appended (docs/benchmarks.md, "Control plane").
   */
  private follow(group: readonly RunnerState[]): void {
    if (group.length === 0) return;
    const live = this.live?.alive() ? this.live : undefined;
    const rest = live ? group.filter((s) => !live.admit(s)) : group;
    if (rest.length === 0) return;
    const opened = this.openGroup(rest);
    if (!live) this.live = opened;
  }

  private openGroup(group: readonly RunnerState[]): LiveGroup {
    const members = new Set<RunnerState>();
    const queue: RecordedEvent[] = [];
    // Every event the group was handed after `covered` is in `recent` (oldest first).
    const recent: RecordedEvent[] = [];
    const positions = group.map((s) => s.position);
    let covered = positions.includes(undefined)
      ? undefined
      : positions.reduce((min, p) => (p !== undefined && min !== undefined && p < min ? p : min));
    let shared: Subscription | undefined;
    let draining = false;
    const drain = async (): Promise<void> => {
      // The subscription hands over a page's events one by one in one synchronous run: take them all as one batch.
      await Promise.resolve();
      while (queue.length > 0 && !this.stopped && members.size > 0) {
        // Live batches stay small: on the Postgres store every open write transaction holds back what
        // readers may see (xmin), so a long read-model transaction would delay every subscriber.
        const batch = queue.splice(0, LIVE_BATCH);
        await this.applyTogether(members, batch);
      }
      if (queue.length === 0) for (const s of members) s.oldestPendingAt = undefined;
    };
    const kick = (): void => {
      if (draining || queue.length === 0 || members.size === 0 || this.stopped) return;
      draining = true;
      drain()
        .catch((err: unknown) => this.failTogether([...members], err))
        // An event queued after the loop saw an empty queue, and before this, is drained now.
        .finally(() => {
          draining = false;
          kick();
        })
        .catch(() => undefined);
    };
    const join = (s: RunnerState): void => {
      s.sub?.unsubscribe();
      members.add(s);
      s.sub = new Subscription(() => {
        members.delete(s);
        if (members.size === 0) shared?.unsubscribe();
      });
    };
    for (const s of group) join(s);
    const subscription = LiveFeed.of(this.store).subscribe(covered, {
      next: (event) => {
        queue.push(event);
        recent.push(event);
        if (recent.length > 2 * RECENT) covered = recent.splice(0, recent.length - RECENT).at(-1)?.position;
        for (const s of members) s.oldestPendingAt ??= event.created.getTime();
        kick();
      },
      error: (err: unknown) => {
        this.failTogether([...members], err);
      },
    });
    // An error delivered while subscribing has already failed every member.
    if (members.size === 0) subscription.unsubscribe();
    else shared = subscription;
    return {
      alive: () => members.size > 0,
      admit: (s) => {
        const at = s.position;
        if (covered !== undefined && (at === undefined || at < covered)) return false;
        // What the group was handed after `at` and has taken off its queue already (applied, or in the
        // batch being applied) goes in front of the queue again; the others skip it by their checkpoints.
        const head = queue[0]?.position;
        const missed = recent.filter((e) => (at === undefined || e.position > at) && (head === undefined || e.position < head));
        queue.unshift(...missed);
        join(s);
        const oldest = queue[0];
        if (oldest) s.oldestPendingAt = oldest.created.getTime();
        kick();
        return true;
      },
    };
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
  private failTogether(group: readonly RunnerState[], err: unknown, own?: ReadonlyMap<RunnerState, unknown>): void {
    if (group.length === 0) return;
    for (const s of group) {
      // Each with its own error where it had one (/readyz names the event that read model could not apply).
      const e = own?.get(s) ?? err;
      // Whatever this read model was doing (a catch-up, a live batch, an earlier retry's timer) is stale now.
      s.gen++;
      s.sub?.unsubscribe();
      s.sub = undefined;
      s.running = false;
      s.caughtUp = false;
      s.lastError = e instanceof Error ? e.message : String(e);
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
    const gens = new Map(group.map((s) => [s, s.gen]));
    const timer = setTimeout(() => {
      // Only the members not failed (or stopped) again since: they have a timer of their own.
      const again = group.filter((s) => gens.get(s) === s.gen);
      const [only] = again;
      if (again.length === 1 && only) void this.run(only);
      else void this.catchUpTogether(again);
    }, delay);
    timer.unref();
    // An earlier timer is not cleared (it may restart other read models too): it skips this one by its generation.
    for (const s of group) s.retryTimer = timer;
  }

  /**
   * Read models whose batches failed: each alone, unless all failed or the
   * database went away — then as one group, so they restart (and follow)
   * together instead of one transaction per read model for good.
   */
  private failMembers(failed: ReadonlyMap<RunnerState, unknown>, all: boolean): void {
    const errors = [...failed.values()];
    const down = errors.find(unreachable);
    if (all || down !== undefined) {
      this.failTogether([...failed.keys()], down ?? errors[0], down === undefined ? failed : undefined);
      return;
    }
    for (const [s, err] of failed) this.fail(s, err);
  }

  /**
   * A live batch for every member in one transaction: the checkpoint rows are
   * locked together (in name order, so two runners on one database wait for
   * each other rather than deadlock), each member applies the events after its
   * own stored checkpoint, and the new checkpoints commit with them. If any of
   * it fails, nothing is kept and each member retries the batch in its own
   * transaction (`applyBatch`), all at once, so only the one that cannot apply
   * it fails and one waiting for its row (a rebuild's swap holds it) does not
   * hold back the others' commits. `members` is the live set: one that left
   * the group meanwhile (failed) is neither failed again nor advanced.
   */
  private async applyTogether(members: ReadonlySet<RunnerState>, events: readonly RecordedEvent[]): Promise<void> {
    const group = [...members];
    const [only] = group;
    if (group.length === 1 && only) {
      try {
        await this.applyBatch(only, events);
      } catch (err) {
        if (members.has(only)) this.fail(only, err);
      }
      return;
    }
    let applied: Map<RunnerState, { stored: Position | undefined; fresh: readonly RecordedEvent[] }> | undefined;
    let sharedErr: unknown;
    try {
      applied = await this.applyInOneTransaction(group, events);
    } catch (err) {
      sharedErr = err;
      this.logger.debug({ err: { message: (err as Error).message } }, 'a shared read-model batch failed; applying it per read model');
    }
    if (applied) {
      for (const [s, { stored, fresh }] of applied) if (members.has(s)) this.advanced(s, fresh.at(-1)?.position ?? stored, fresh.length);
      return;
    }
    const failed = new Map<RunnerState, unknown>();
    let tried = 0;
    await Promise.all(
      group.map(async (s) => {
        if (!members.has(s)) return;
        tried++;
        try {
          await this.applyBatch(s, events);
        } catch (err) {
          if (members.has(s)) failed.set(s, err);
        }
      }),
    );
    if (failed.size > 0) this.failMembers(failed, failed.size === tried || unreachable(sharedErr));
  }

  private async applyInOneTransaction(
    members: readonly RunnerState[],
    events: readonly RecordedEvent[],
  ): Promise<Map<RunnerState, { stored: Position | undefined; fresh: readonly RecordedEvent[] }>> {
    const client = await this.pool.connect();
    try {
      const byName = [...members].sort((a, b) => (a.projection.name < b.projection.name ? -1 : 1));
      const opened = (await client.query(
        `BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL lock_timeout = '${SHARED_LOCK_TIMEOUT}';
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
    this.settleWaiters(s);
  }

  private settleWaiters(s: RunnerState): void {
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

/** Errors that mean the database (or the store) is not there, rather than a read model that cannot apply an event. */
function unreachable(err: unknown): boolean {
  return err instanceof EventStoreUnavailableError || isConnectionError(err);
}

interface LiveGroup {
  /** False once its last member left: its subscription has ended. */
  alive(): boolean;
  /** Adds a read model that caught up on its own, if the group still holds every event after its position; false otherwise. */
  admit(s: RunnerState): boolean;
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
  /** Bumped by each failure and by stop(): a catch-up, live group or retry timer of an older generation leaves this read model alone. */
  gen: number;
}
