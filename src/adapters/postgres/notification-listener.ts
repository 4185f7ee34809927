import pg from 'pg';
import type { Logger } from '../logger.js';
import { EVENTS_CHANNEL } from './event-store.schema.js';

/**
 * One LISTEN connection shared by every subscription of a store, held only
 * while at least one subscription is live. On loss it reconnects with backoff;
 * meanwhile subscriptions keep polling, and each reconnect wakes them all
 * (a notification sent while we were away is lost, the rows are not).
 */
export class NotificationListener {
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
