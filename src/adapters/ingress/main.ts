import { ConfigError, loadConfig } from '../config.js';
import { CommandHandler } from '../../commands/command-handler.js';
import { activityRecorder } from '../../commands/ingress/ingress-commands.js';
import type { EventStore } from '../../domain/event-store.port.js';
import { EsdbEventStore } from '../esdb/esdb-event-store.js';
import { createLogger } from '../logger.js';
import { createPool } from '../postgres/pool.js';
import { PostgresEventStore } from '../postgres/postgres-event-store.js';
import { IngressPortHandlers, startIngress } from './ingress.js';

/**
 * `npm run ingress`: the ingress proxy as its own process, for production
 * (several replicas behind a load balancer). It reads the route table the
 * control plane's projections keep in DATABASE_URL and writes nothing but
 * VmActivityRecorded events; it needs neither the token key nor the agents'
 * tokens. It is stateless: any number of replicas agree, and a restart loses
 * nothing.
 */
async function main(): Promise<void> {
  let config;
  try {
    config = loadConfig();
    if (!config.DATABASE_URL) throw new ConfigError(['DATABASE_URL: required: the control plane’s Postgres, where the route table is']);
    if (!config.INGRESS_DOMAIN)
      throw new ConfigError(['INGRESS_DOMAIN: required: the domain published URLs use (the same as the control plane’s)']);
  } catch (err) {
    if (err instanceof ConfigError) {
      process.stderr.write(`${err.message}\n`);
      process.exit(2);
    }
    throw err;
  }
  const logger = createLogger(config.LOG_LEVEL, 'fleet-ingress');
  const pool = createPool({ url: config.DATABASE_URL, max: 20, applicationName: 'fleet-ingress', logger });
  const store: EventStore = config.EVENTSTORE_URL
    ? new EsdbEventStore({ connectionString: config.EVENTSTORE_URL, logger })
    : new PostgresEventStore({ pool, logger });
  const ingress = await startIngress({
    pool,
    domain: config.INGRESS_DOMAIN,
    host: config.INGRESS_HOST,
    port: config.INGRESS_PORT ?? 8081,
    routeCacheMs: config.INGRESS_ROUTE_CACHE_MS,
    activityFlushMs: config.ACTIVITY_COALESCE_MS,
    recordActivity: activityRecorder(new CommandHandler(store), { correlationId: 'ingress-activity', actor: 'ingress' }),
    handlers: new IngressPortHandlers(),
    logger,
  });
  let stopping = false;
  const shutdown = async (signal: string): Promise<void> => {
    if (stopping) return;
    stopping = true;
    logger.info({ signal }, 'shutting down');
    await ingress.close().catch((err: unknown) => logger.warn({ err }, 'ingress close failed'));
    await store.close().catch(() => undefined);
    await pool.end().catch(() => undefined);
    process.exit(0);
  };
  process.on('SIGINT', () => void shutdown('SIGINT'));
  process.on('SIGTERM', () => void shutdown('SIGTERM'));
}

void main();
