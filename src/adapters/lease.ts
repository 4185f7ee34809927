import pg from 'pg';
import type { Logger } from 'pino';
import { withTimeout } from './timeout.js';

export interface LeaseOptions {
  readonly databaseUrl: string;
  /** What the lease guards, e.g. `reconciler`: one holder per name across every replica on this database. */
  readonly name: string;
  /** Standby: how often to try to take it. Holder: how often to check the session that holds it is alive. */
  readonly pollMs: number;
  readonly logger: Logger;
  /** Called once this replica holds the lease. */
  readonly onAcquired: () => void | Promise<void>;
  /** Called when it no longer does (lost connection, or stop()). The work must stop. */
  readonly onLost: () => void | Promise<void>;
}

/**
 * A leader lease on a Postgres session-level advisory lock, held on a
 * dedicated connection (not the pool: a pooled connection would hand the
 * lock to whichever query ran last). When the holder dies its connection
 * closes and the server releases the lock at once; a standby polling every
 * `pollMs` takes it within about one poll. A holder that cannot reach the
 * server steps down within a poll or two, and server-side TCP keepalives
 * (set on the session) free the lock of a holder that vanished without a
 * FIN within ~15 s. In the short window where a partitioned old holder has
 * not noticed yet, the work it still does is safe: every reconciler action
 * is an append at an expected revision, so the two replicas conflict, they
 * do not corrupt.
 */
export class PgAdvisoryLease {
  private client: pg.Client | undefined;
  private timer: NodeJS.Timeout | undefined;
  private stopped = true;
  private holding = false;
  private ticking: Promise<void> | undefined;

  constructor(private readonly opts: LeaseOptions) {}

  get held(): boolean {
    return this.holding;
  }

  start(): void {
    if (!this.stopped) return;
    this.stopped = false;
    this.schedule(0);
  }

  async stop(): Promise<void> {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    await this.ticking?.catch(() => undefined);
    const client = this.client;
    this.client = undefined;
    if (this.holding) await this.lose('stopping');
    if (client) {
      await client.query('SELECT pg_advisory_unlock(hashtextextended($1, 0))', [this.key]).catch(() => undefined);
      await withTimeout(client.end(), 2000).catch(() => undefined);
    }
  }

  private get key(): string {
    return `fleet-lease:${this.opts.name}`;
  }

  private schedule(ms: number): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      this.ticking = this.tick().finally(() => {
        this.ticking = undefined;
        this.schedule(this.opts.pollMs);
      });
    }, ms);
    this.timer.unref();
  }

  private async tick(): Promise<void> {
    try {
      if (!this.client) this.client = await this.connect();
      const client = this.client;
      if (this.holding) {
        await withTimeout(client.query('SELECT 1'), Math.max(this.opts.pollMs * 2, 1000));
        return;
      }
      const { rows } = await withTimeout(
        client.query<{ ok: boolean }>('SELECT pg_try_advisory_lock(hashtextextended($1, 0)) AS ok', [this.key]),
        Math.max(this.opts.pollMs * 2, 1000),
      );
      if (rows[0]?.ok && !this.stopped) {
        this.holding = true;
        this.opts.logger.info({ lease: this.opts.name }, 'lease acquired');
        await this.opts.onAcquired();
      }
    } catch (err) {
      this.opts.logger.warn({ lease: this.opts.name, err: { message: (err as Error).message } }, 'lease session failed; reconnecting');
      this.drop();
      if (this.holding) await this.lose('session lost');
    }
  }

  private async lose(why: string): Promise<void> {
    this.holding = false;
    this.opts.logger.warn({ lease: this.opts.name, why }, 'lease released');
    await Promise.resolve(this.opts.onLost()).catch((err: unknown) => this.opts.logger.error({ err }, 'lease onLost failed'));
  }

  private drop(): void {
    const c = this.client;
    this.client = undefined;
    if (c) void withTimeout(c.end(), 1000).catch(() => undefined);
  }

  private async connect(): Promise<pg.Client> {
    const client = new pg.Client({
      connectionString: this.opts.databaseUrl,
      application_name: `fleet-lease-${this.opts.name}`,
      keepAlive: true,
      keepAliveInitialDelayMillis: 5000,
    });
    client.on('error', (err) => {
      this.opts.logger.warn({ lease: this.opts.name, err: { message: err.message } }, 'lease connection error');
      if (this.client === client) {
        this.drop();
        if (this.holding) void this.lose('connection error');
      }
    });
    await withTimeout(client.connect(), 5000);
    // So the server frees the lock of a holder that disappeared without closing its socket.
    await client.query('SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; SET tcp_keepalives_count = 4');
    return client;
  }
}
