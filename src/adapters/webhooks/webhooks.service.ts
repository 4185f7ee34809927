import type { Pool } from 'pg';
import type { Logger } from 'pino';
import { Counter } from 'prom-client';
import type { EventStore } from '../../domain/event-store.port.js';
import type { SecretBox } from '../../domain/secret-box.port.js';
import { ProjectionRunner } from '../../projections/runner.js';
import { webhookOutboxProjection } from '../../projections/webhooks/webhook-outbox.projection.js';
import type { Config } from '../config.js';
import type { Metrics } from '../http/metrics.js';
import { runMigrations } from '../postgres/migrations.js';
import { WebhookDispatcher } from './dispatcher.js';

export interface Webhooks {
  /** Enqueues deliveries from the event store (a runner of its own: read-model rebuilds never touch it). */
  readonly runner: ProjectionRunner;
  readonly dispatcher: WebhookDispatcher;
  registerMetrics(metrics: Metrics): void;
}

/** The webhook consumer and its dispatcher, started; both stop with the service (closers). */
export async function startWebhooks(deps: {
  store: EventStore;
  pool: Pool;
  config: Config;
  logger: Logger;
  secrets: SecretBox;
  closers: Array<() => Promise<void>>;
}): Promise<Webhooks> {
  const { config, logger } = deps;
  await runMigrations(deps.pool, webhookOutboxProjection.migrations, { logger });
  const runner = new ProjectionRunner(deps.store, deps.pool, [webhookOutboxProjection], logger.child({ component: 'webhooks' }));
  deps.closers.push(() => runner.stop());
  await runner.start();
  let outcomes: Counter<'outcome'> | undefined;
  const dispatcher = new WebhookDispatcher({
    pool: deps.pool,
    secrets: deps.secrets,
    logger: logger.child({ component: 'webhooks' }),
    allowPrivate: config.WEBHOOK_ALLOW_PRIVATE,
    maxAttempts: config.WEBHOOK_MAX_ATTEMPTS,
    retryBaseMs: config.WEBHOOK_RETRY_BASE_MS,
    maxBackoffMs: config.WEBHOOK_RETRY_MAX_MS,
    timeoutMs: config.WEBHOOK_TIMEOUT_MS,
    intervalMs: config.WEBHOOK_DISPATCH_INTERVAL_MS,
    onOutcome: (o) => outcomes?.inc({ outcome: o }),
  });
  deps.closers.push(() => dispatcher.stop());
  dispatcher.start();
  return {
    runner,
    dispatcher,
    registerMetrics(metrics) {
      outcomes = new Counter({
        name: 'fleet_webhook_attempts_total',
        help: 'Webhook delivery attempts by outcome (delivered, failed and retried, dead)',
        labelNames: ['outcome'],
        registers: [metrics.registry],
      });
      metrics.gauge('fleet_webhook_deliveries', 'Webhook deliveries by status', ['status'], async () => {
        const { rows } = await deps.pool.query<{ status: string; n: string }>(
          'SELECT status, count(*)::text AS n FROM webhook_deliveries GROUP BY status',
        );
        return rows.map((r) => ({ labels: { status: r.status }, value: Number(r.n) }));
      });
    },
  };
}
