import { mkdir } from 'node:fs/promises';
import { resolve, join } from 'node:path';
import { ConfigError, loadConfig } from './adapters/config.js';
import { LOCAL_HOST_CPU_OVERCOMMIT_RATIO, startLocalAgent, type LocalAgent } from './adapters/local-agent.js';
import { createLogger } from './adapters/logger.js';
import { startEmbeddedPostgres, type EmbeddedPostgres } from './adapters/postgres/embedded.js';
import { loadOrCreateSecrets } from './adapters/secrets.js';
import { apiKeysFrom, startService, type Service } from './adapters/service.js';
import { e2bShellExports } from './adapters/http/e2b/e2b-shell.js';
import { ingressSettingsOf, startIngress } from './adapters/ingress/ingress.js';
import { registerHostRequestSchema } from './commands/host/host-commands.js';

/**
 * The control plane process: config, the embedded Postgres when nothing else
 * is configured, the service, one local host agent on the embedded default,
 * and graceful shutdown on SIGINT/SIGTERM with nothing of ours left running.
 */
async function main(): Promise<void> {
  let config;
  try {
    config = loadConfig();
  } catch (err) {
    if (err instanceof ConfigError) {
      process.stderr.write(`${err.message}\n`);
      process.exit(2);
    }
    throw err;
  }
  const logger = createLogger(config.LOG_LEVEL, 'fleet');
  const dataDir = resolve(config.DATA_DIR);
  await mkdir(dataDir, { recursive: true });
  const { secrets, created } = await loadOrCreateSecrets(dataDir);
  const embedded = !config.DATABASE_URL;

  const stops: Array<() => Promise<void>> = [];
  let stopping = false;
  const shutdown = async (signal: string, code = 0): Promise<void> => {
    if (stopping) return;
    stopping = true;
    logger.info({ signal }, 'shutting down');
    for (const stop of stops.reverse()) await stop().catch((err: unknown) => logger.warn({ err }, 'shutdown step failed'));
    logger.info('stopped');
    logger.flush();
    process.exit(code);
  };
  process.on('SIGINT', () => void shutdown('SIGINT'));
  process.on('SIGTERM', () => void shutdown('SIGTERM'));
  // A stray rejection is a bug to see in the logs, not a reason to drop every client's requests.
  process.on('unhandledRejection', (reason) => logger.error({ err: reason }, 'unhandled promise rejection'));

  try {
    let databaseUrl = config.DATABASE_URL;
    if (!databaseUrl) {
      logger.info({ dataDir: join(dataDir, 'pg') }, 'starting the embedded Postgres');
      const pg: EmbeddedPostgres = await startEmbeddedPostgres({
        dataDir: join(dataDir, 'pg'),
        port: config.EMBEDDED_PG_PORT,
        logger,
        password: secrets.embedded_pg_password,
      });
      stops.push(() => pg.stop());
      databaseUrl = pg.url;
    }
    const adminKey = config.ADMIN_API_KEY ?? secrets.admin_api_key;
    const ingress = ingressSettingsOf(config, embedded);
    const tenantKeys = config.API_KEYS.length > 0 || !embedded ? config.API_KEYS : [{ tenant: 'demo', key: secrets.demo_api_key }];
    const startsLocalAgent = config.START_LOCAL_AGENT ?? embedded;
    // Until the local host is registered a create finds no host: /readyz says so instead of a ready that answers 409.
    let localHost: 'starting' | 'registered' = 'starting';
    const service: Service = await startService({
      config,
      logger,
      databaseUrl,
      tokenEncryptionKey: Buffer.from(config.TOKEN_ENCRYPTION_KEY ?? secrets.token_encryption_key, 'base64'),
      apiKeys: apiKeysFrom(adminKey, tenantKeys),
      ingress: ingress.settings,
      ...(startsLocalAgent && {
        readinessChecks: {
          local_host: () =>
            localHost === 'registered' ? Promise.resolve() : Promise.reject(new Error('the local host agent is starting')),
        },
      }),
    });
    stops.push(() => service.close());
    await service.app.listen({ host: config.HOST, port: config.PORT });
    const apiUrl = `http://${config.HOST}:${config.PORT}`;
    let ingressUrl: string | undefined;
    if (ingress.run && ingress.settings) {
      const proxy = await startIngress({
        pool: service.pool,
        domain: ingress.settings.domain,
        host: config.INGRESS_HOST,
        port: ingress.port,
        routeCacheMs: config.INGRESS_ROUTE_CACHE_MS,
        activityFlushMs: config.ACTIVITY_COALESCE_MS,
        recordActivity: service.recordIngressActivity,
        handlers: service.ingressHandlers,
        wake: service.resumeVm,
        wakeTimeoutMs: config.INGRESS_RESUME_TIMEOUT_MS,
        logger,
      });
      stops.push(() => proxy.close());
      ingressUrl = proxy.url;
    }

    if (startsLocalAgent) {
      const agent: LocalAgent = await startLocalAgent({ dataDir, port: config.LOCAL_AGENT_PORT, token: secrets.local_agent_token, logger });
      stops.push(() => agent.stop());
      await service.hosts.register(
        registerHostRequestSchema.parse({
          id: 'local',
          url: agent.url,
          token: secrets.local_agent_token,
          backend: 'process',
          region: 'local',
          capacity_overrides: { cpu_overcommit_ratio: config.CPU_OVERCOMMIT_RATIO ?? LOCAL_HOST_CPU_OVERCOMMIT_RATIO },
        }),
        { correlationId: 'startup', actor: 'system', tenantId: 'admin' },
      );
      localHost = 'registered';
      logger.info({ host: 'local', url: agent.url }, 'local host registered');
    }
    const showDemo = embedded && config.API_KEYS.length === 0;
    if (created && (!config.ADMIN_API_KEY || showDemo)) {
      // Printed once, when generated, so a newcomer can follow the README; later starts only say where they are.
      process.stdout.write(
        `\nFleet control plane on ${apiUrl}\n` +
          (!config.ADMIN_API_KEY ? `  admin key:  ${adminKey}\n` : '') +
          (showDemo ? `  demo tenant key: ${secrets.demo_api_key}\n` : '') +
          `  (kept in ${join(dataDir, 'secrets.json')}; shown again by: npm run fleet -- keys)\n\n`,
      );
    } else {
      logger.info(
        { api: apiUrl, keys_file: join(dataDir, 'secrets.json') },
        'ready; the generated keys are shown by: npm run fleet -- keys',
      );
    }
    // Every start: what points the stock e2b SDK here (docs/e2b-compatibility.md), with the key where the demo key is shown.
    process.stdout.write(`E2B SDK:\n${e2bShellExports(apiUrl, created && showDemo ? secrets.demo_api_key : undefined, ingressUrl)}\n`);
  } catch (err) {
    logger.fatal({ err }, 'start-up failed');
    await shutdown('startup-failure', 1);
  }
}

void main();
