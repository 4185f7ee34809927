import type { FastifyInstance } from 'fastify';
import type { Logger } from 'pino';
import { CommandHandler } from '../commands/command-handler.js';
import { HostCommands } from '../commands/host/host-commands.js';
import { PlacementView } from '../commands/placement/placement-view.js';
import { VmCommands } from '../commands/vm/vm-commands.js';
import { Placer } from '../commands/placement/place-and-reserve.js';
import { Reconciler, type ReconcileSummary } from '../commands/reconcile/reconciler.js';
import { deadLettersProjection } from '../projections/dead-letters/dead-letters.projection.js';
import { countDeadLettersByState } from '../projections/dead-letters/dead-letters.queries.js';
import { Counter } from 'prom-client';
import { deadLetterRoutes } from './http/dead-letters.routes.js';
import { vmHealthRoutes } from './http/vm-health.routes.js';
import { vmHealthProjection } from '../projections/vm-health/vm-health.projection.js';
import { PgAdvisoryLease } from './lease.js';
import { StandbyCheckpoints } from '../commands/migrate/standby-checkpoints.js';
import { parseAgentDelayHook, TEST_HOOK_AGENT_DELAY, withAgentDelays } from './test-hooks.js';
import type { EventStore } from '../domain/event-store.port.js';
import type { HostAgentConnector } from '../domain/host-agent.port.js';
import { DEFAULT_SPEC_LIMITS } from '../domain/vm/spec.js';
import { hostsProjection } from '../projections/hosts/hosts.projection.js';
import { allocationByHost, listSchedulableHostIds } from '../projections/hosts/hosts.queries.js';
import type { Projection } from '../projections/projection.js';
import { CHECKPOINTS_MIGRATION, ProjectionRunner } from '../projections/runner.js';
import { vmsProjection } from '../projections/vms/vms.projection.js';
import { billingProjection } from '../projections/billing/billing.projection.js';
import { metricsProjection } from '../projections/metrics/metrics.projection.js';
import { snapshotsProjection } from '../projections/snapshots/snapshots.projection.js';
import * as snapshotQueries from '../projections/snapshots/snapshots.queries.js';
import { SnapshotCommands } from '../commands/snapshot/snapshot-commands.js';
import { ForkMigrate } from '../commands/migrate/fork-migrate.js';
import { VmMemory } from '../commands/vm/vm-memory.js';
import { vmMemoryRoutes } from './http/vm-memory.routes.js';
import { snapshotRoutes } from './http/snapshots.routes.js';
import { registerConsumerMetrics } from './http/consumer-metrics.js';
import { countVmsByStateAndHost } from '../projections/vms/vms.queries.js';
import { listLiveVmHints } from '../projections/dead-letters/live-vms.queries.js';
import type { Config } from './config.js';
import { AesGcmSecretBox } from './crypto.js';
import { EsdbEventStore } from './esdb/esdb-event-store.js';
import { HostAgentClientFactory } from './host-agent.client.js';
import { buildApp } from './http/app.js';
import { ApiKeys, ADMIN_TENANT, type ApiKey } from './http/auth.js';
import { hostRoutes } from './http/hosts.routes.js';
import { Metrics } from './http/metrics.js';
import { vmRoutes } from './http/vms.routes.js';
import { observeRoutes } from './http/observe.routes.js';
import { webhookRoutes } from './http/webhooks.routes.js';
import { startWebhooks } from './webhooks/webhooks.service.js';
import { registerHostObserveMetrics } from './http/observe-metrics.js';
import { networkRoutes } from './http/network.routes.js';
import { usageRoutes } from './http/usage.routes.js';
import { eventsRoutes, FeedStats } from './http/events.routes.js';
import { auditRoutes } from './http/audit.routes.js';
import { ENVD_PORT, EnvdTokens } from './http/e2b/e2b-auth.js';
import { e2bRoutes } from './http/e2b/e2b.routes.js';
import { envdForwardRoutes, envdIngressHandler } from './http/e2b/envd-forward.routes.js';
import { lifecycleRoutes } from './http/lifecycle.routes.js';
import { VmLifecycle } from '../commands/vm/vm-lifecycle.js';
import { vmEventsProjection } from '../projections/vm-events/vm-events.projection.js';
import { runMigrations } from './postgres/migrations.js';
import { createPool } from './postgres/pool.js';
import { PostgresEventStore } from './postgres/postgres-event-store.js';
import { ingressProjection } from '../projections/ingress/ingress.projection.js';
import { networksProjection } from '../projections/networks/networks.projection.js';
import { NetworkCommands } from '../commands/network/network-commands.js';
import { tenantNetworkRoutes } from './http/networks.routes.js';
import { countIngressRoutes } from '../projections/ingress/ingress.queries.js';
import { activityRecorder, IngressCommands, type IngressSettings } from '../commands/ingress/ingress-commands.js';
import { ingressRoutes } from './http/ingress.routes.js';
import { IngressPortHandlers } from './ingress/ingress-proxy.js';

/** Every read model the service keeps. */
export const PROJECTIONS: readonly Projection[] = [
  hostsProjection,
  vmsProjection,
  billingProjection,
  metricsProjection,
  deadLettersProjection,
  vmHealthProjection,
  snapshotsProjection,
  ingressProjection,
  networksProjection,
  vmEventsProjection,
];

export interface ServiceOptions {
  readonly config: Config;
  readonly logger: Logger;
  /** Postgres for read models (and events unless config.EVENTSTORE_URL is set). */
  readonly databaseUrl: string;
  readonly tokenEncryptionKey: Buffer;
  readonly apiKeys: readonly ApiKey[];
  /** Tests may pass their own connector (still a real HTTP client, e.g. with shorter timeouts). */
  readonly connector?: HostAgentConnector;
  /** False in tests that run many services: prom-client's default process metrics are global. */
  readonly defaultMetrics?: boolean;
  readonly httpLogger?: boolean;
  /** Ingress URL settings; default: from INGRESS_DOMAIN (unset: nothing is published). */
  readonly ingress?: IngressSettings | undefined;
  /** More /readyz checks from the process (main.ts: the embedded default's local host, until it is registered). */
  readonly readinessChecks?: Readonly<Record<string, () => Promise<void>>>;
}

export interface Service {
  readonly app: FastifyInstance;
  readonly store: EventStore;
  readonly runner: ProjectionRunner;
  readonly hosts: HostCommands;
  readonly vms: VmCommands;
  readonly reconciler: Reconciler;
  readonly snapshots: SnapshotCommands;
  /** Standby checkpoints (CHECKPOINT_INTERVAL_MS); its tick runs on the lease holder. */
  readonly standby: StandbyCheckpoints;
  /** The webhook consumer (its own runner) and dispatcher. */
  readonly webhooks: import('./webhooks/webhooks.service.js').Webhooks;
  /** Whether this replica holds the reconciler lease. */
  isReconcilerLeader(): boolean;
  readonly pool: import('pg').Pool;
  /** Present when an ingress domain is configured. */
  readonly ingress: IngressCommands | undefined;
  /** Per-port handlers for the ingress proxies this process runs (e.g. envd for the E2B layer). */
  readonly ingressHandlers: IngressPortHandlers;
  /** What a proxy calls once per VM per flush (ingress traffic as idle-expiry activity). */
  readonly recordIngressActivity: (vmId: string) => Promise<void>;
  /** What an in-process ingress calls for a request to a paused VM: resume it (idempotent; as the VM's tenant). */
  readonly resumeVm: (vmId: string, tenantId: string) => Promise<void>;
  close(): Promise<void>;
}

/** Wires the control plane: stores, read models, command handlers, API. Process concerns stay in main.ts. */
export async function startService(opts: ServiceOptions): Promise<Service> {
  const { config, logger } = opts;
  const pool = createPool({ url: opts.databaseUrl, max: 20, applicationName: 'fleet-control-plane', logger });
  const closers: Array<() => Promise<void>> = [
    async () => {
      await pool.end();
    },
  ];
  const close = async (): Promise<void> => {
    for (const c of closers.reverse()) await c().catch((err: unknown) => logger.warn({ err }, 'shutdown step failed'));
  };
  try {
    let store: EventStore;
    if (config.EVENTSTORE_URL) {
      store = new EsdbEventStore({ connectionString: config.EVENTSTORE_URL, logger });
    } else {
      await PostgresEventStore.migrate(pool, logger);
      store = new PostgresEventStore({ pool, logger });
    }
    closers.push(() => store.close());
    await runMigrations(pool, [CHECKPOINTS_MIGRATION, ...PROJECTIONS.flatMap((p) => p.migrations)], { logger });

    const runner = new ProjectionRunner(store, pool, PROJECTIONS, logger);
    closers.push(() => runner.stop());
    await runner.start();

    const handler = new CommandHandler(store);
    const secretBox = new AesGcmSecretBox(opts.tokenEncryptionKey);
    const webhooks = await startWebhooks({ store, pool, config, logger, secrets: secretBox, closers });
    let connector = opts.connector ?? new HostAgentClientFactory({ timeoutMs: config.AGENT_CALL_TIMEOUT_MS, logger });
    const delays = parseAgentDelayHook(process.env[TEST_HOOK_AGENT_DELAY]);
    if (delays) {
      logger.warn({ hook: TEST_HOOK_AGENT_DELAY, delays: Object.fromEntries(delays) }, 'TEST HOOK active: agent calls are delayed');
      connector = withAgentDelays(connector, delays);
    }
    const hosts = new HostCommands(handler, connector, secretBox, config.CPU_OVERCOMMIT_RATIO ?? 1);
    const view = new PlacementView(hosts, () => listSchedulableHostIds(pool));
    hosts.onAppended((hostId, state, revision) => view.set(hostId, state, revision));
    const placer = new Placer(handler, view, { policy: config.PLACEMENT_POLICY });
    const vms = new VmCommands(
      handler,
      hosts,
      placer,
      secretBox,
      {
        limits: { ...DEFAULT_SPEC_LIMITS, maxStartupScriptTimeoutMs: config.MAX_STARTUP_SCRIPT_TIMEOUT_MS },
        execDefaultTimeoutMs: config.EXEC_DEFAULT_TIMEOUT_MS,
        execMaxTimeoutMs: config.EXEC_MAX_TIMEOUT_MS,
        startupScriptTimeoutMs: config.STARTUP_SCRIPT_TIMEOUT_MS,
        activityCoalesceMs: config.ACTIVITY_COALESCE_MS,
        egressRegistry: config.EGRESS_PROXIES,
      },
      logger,
    );

    const snapshots = new SnapshotCommands(
      handler,
      hosts,
      vms,
      {
        latestReadyOfVm: (vmId) => snapshotQueries.latestReadySnapshotOfVm(pool, vmId),
        dependentsOf: (id) => snapshotQueries.dependentsOf(pool, id),
        expired: (now) => snapshotQueries.expiredSnapshots(pool, now),
        idleLayers: (before) => snapshotQueries.idleLayers(pool, before),
        layersOverCap: (max) => snapshotQueries.layersOverCap(pool, max),
        liveVmsSeededFrom: (id) => snapshotQueries.liveVmsSeededFrom(pool, id),
        deletedWithHolders: () => snapshotQueries.deletedWithHolders(pool),
      },
      {
        defaultRetentionMs: config.DEFAULT_SNAPSHOT_RETENTION_MS,
        quota: { max_count: config.SNAPSHOT_QUOTA_MAX_COUNT, max_bytes: config.SNAPSHOT_QUOTA_MAX_BYTES },
        buildQuota: { max_count: config.BUILD_SNAPSHOT_QUOTA_MAX_COUNT, max_bytes: config.BUILD_SNAPSHOT_QUOTA_MAX_BYTES },
        pullTimeoutMs: config.ARTIFACT_PULL_TIMEOUT_MS,
        checkpointTimeoutMs: Math.max(config.AGENT_CALL_TIMEOUT_MS, 120_000),
        idleTtlMs: config.ARTIFACT_IDLE_TTL_MS,
        maxPerTenant: config.ARTIFACT_MAX_PER_TENANT,
        gcIntervalMs: config.SNAPSHOT_GC_INTERVAL_MS,
      },
      logger.child({ component: 'snapshots' }),
      new CommandHandler(store, undefined, 200),
    );
    vms.setSeedArtifacts(snapshots);
    const networks = new NetworkCommands(handler, { pool: config.NETWORK_POOL, prefixLen: config.NETWORK_PREFIX_LEN });
    vms.setNetworks(networks);
    const ingressSettings: IngressSettings | undefined =
      opts.ingress ?? (config.INGRESS_DOMAIN ? { domain: config.INGRESS_DOMAIN, scheme: config.INGRESS_SCHEME } : undefined);
    const ingress = ingressSettings
      ? new IngressCommands(handler, secretBox, ingressSettings, logger.child({ component: 'ingress' }))
      : undefined;
    vms.ingress = ingress;
    const lifecycle = new VmLifecycle(handler, vms, hosts, logger.child({ component: 'lifecycle' }));
    const forkMigrate = new ForkMigrate(handler, hosts, placer, vms, snapshots, logger.child({ component: 'migrate' }));
    const memory = new VmMemory(handler, hosts, placer, vms, snapshots, logger.child({ component: 'memory' }));

    const metrics = new Metrics({ defaultMetrics: opts.defaultMetrics });
    metrics.gauge(
      'fleet_projection_lag_seconds',
      'Seconds the read model is behind the newest event it has been handed',
      ['projection'],
      () => runner.status().map((s) => ({ labels: { projection: s.name }, value: s.lagSeconds })),
    );
    metrics.gauge('fleet_projection_events_applied', 'Events applied by this process per read model', ['projection'], () =>
      runner.status().map((s) => ({ labels: { projection: s.name }, value: s.eventsApplied })),
    );
    metrics.gauge('fleet_vms', 'VMs by state and host (read model)', ['state', 'host'], async () =>
      (await countVmsByStateAndHost(pool)).map((r) => ({ labels: { state: r.state, host: r.host_id }, value: r.count })),
    );
    metrics.gauge('fleet_host_capacity', 'Host capacity: total and allocated by resource', ['host', 'resource', 'kind'], async () =>
      (await allocationByHost(pool)).flatMap((h) => [
        { labels: { host: h.id, resource: 'cpus', kind: 'total' }, value: h.capacity.cpus },
        { labels: { host: h.id, resource: 'cpus', kind: 'allocated' }, value: h.allocated.cpus },
        { labels: { host: h.id, resource: 'ram_mb', kind: 'total' }, value: h.capacity.ram_mb },
        { labels: { host: h.id, resource: 'ram_mb', kind: 'allocated' }, value: h.allocated.ram_mb },
        { labels: { host: h.id, resource: 'vm_count', kind: 'total' }, value: h.capacity.vm_count },
        { labels: { host: h.id, resource: 'vm_count', kind: 'allocated' }, value: h.allocated.vm_count },
      ]),
    );

    metrics.gauge('fleet_ingress_routes', 'Published ingress routes (read model)', [], async () => [
      { labels: {}, value: await countIngressRoutes(pool) },
    ]);

    const feedStats = new FeedStats();
    registerConsumerMetrics(metrics, { pool, store, runner, feed: feedStats });

    // Reconciler: runs on the one replica holding the lease. Projections run on every replica:
    // their checkpoint row is locked per batch, so they are already safe side by side, and each
    // replica needs its own runner caught up for read-your-writes.
    const reconcileCycles = new Counter({
      name: 'fleet_reconcile_cycles_total',
      help: 'Reconcile cycles completed by this replica',
      registers: [metrics.registry],
    });
    const reconcileActions = new Counter({
      name: 'fleet_reconcile_actions_total',
      help: 'Reconciler findings and actions by kind (ReconcileSummary fields), summed over cycles',
      labelNames: ['kind'],
      registers: [metrics.registry],
    });
    const onCycle = (summary: ReconcileSummary): void => {
      reconcileCycles.inc();
      for (const [k, v] of Object.entries(summary))
        if (typeof v === 'number' && k !== 'cycle' && k !== 'duration_ms' && v > 0) reconcileActions.inc({ kind: k }, v);
    };
    const reconciler = new Reconciler(
      handler,
      hosts,
      vms,
      {
        hostIds: async () => (await listSchedulableHostIds(pool)).map((h) => h.id),
        liveVms: () => listLiveVmHints(pool),
      },
      {
        intervalMs: config.RECONCILE_INTERVAL_MS,
        taskStuckTimeoutMs: config.TASK_STUCK_TIMEOUT_MS,
        defaultIdleTimeoutMs: config.DEFAULT_IDLE_TIMEOUT_MS,
        orphanDestroyMaxRetries: config.ORPHAN_DESTROY_MAX_RETRIES,
        hostUnreachableAfterCycles: config.HOST_UNREACHABLE_AFTER_CYCLES,
        halfDoneGraceMs: config.RECONCILE_GRACE_MS,
        agentTimeoutMs: config.RECONCILE_AGENT_TIMEOUT_MS,
        activityCoalesceMs: config.ACTIVITY_COALESCE_MS,
      },
      logger.child({ component: 'reconciler' }),
      onCycle,
    );
    reconciler.idlePauser = memory;
    reconciler.lazyWatcher = forkMigrate;
    const standby = new StandbyCheckpoints(
      handler,
      hosts,
      async () => (await listSchedulableHostIds(pool)).map((h) => h.id),
      () => listLiveVmHints(pool),
      { intervalMs: config.CHECKPOINT_INTERVAL_MS, leaseMs: Math.max(2 * config.CHECKPOINT_INTERVAL_MS, 120_000) },
      logger.child({ component: 'standby-checkpoints' }),
    );
    if (standby.enabled) forkMigrate.standby = standby;
    const lease = new PgAdvisoryLease({
      databaseUrl: opts.databaseUrl,
      name: 'reconciler',
      pollMs: config.LEASE_POLL_MS,
      logger,
      onAcquired: () => {
        reconciler.start();
        snapshots.start();
        standby.start();
      },
      onLost: async () => {
        await Promise.all([reconciler.stop(), snapshots.stop(), standby.stop()]);
      },
    });
    metrics.gauge('fleet_reconciler_leader', '1 when this replica holds the reconciler lease', [], () => [
      { labels: {}, value: lease.held ? 1 : 0 },
    ]);
    metrics.gauge('fleet_reconcile_last_cycle', "Fields of this replica's last ReconcileSummary", ['field'], () =>
      Object.entries(reconciler.lastSummary ?? {}).flatMap(([k, v]) => (typeof v === 'number' ? [{ labels: { field: k }, value: v }] : [])),
    );
    metrics.gauge(
      'fleet_egress_endpoints',
      "Proxy-mode VMs' egress endpoints probed by this replica's last reconcile cycle, by provider and health",
      ['provider', 'state'],
      () => reconciler.lastEgressEndpoints.map((e) => ({ labels: { provider: e.provider, state: e.state }, value: e.count })),
    );
    metrics.gauge('fleet_dead_letters', 'Dead letters by state and kind (read model)', ['state', 'kind'], async () =>
      (await countDeadLettersByState(pool)).map((r) => ({ labels: { state: r.state, kind: r.kind }, value: r.count })),
    );

    registerHostObserveMetrics(metrics, hosts, async () => (await listSchedulableHostIds(pool)).map((h) => h.id));
    webhooks.registerMetrics(metrics);

    const rywTimeout = config.READ_YOUR_WRITES_TIMEOUT_MS;
    const apiKeys = new ApiKeys(opts.apiKeys);
    const envdTokens = new EnvdTokens(opts.tokenEncryptionKey);
    // envd (E2B_SANDBOX_URL) on every ingress this process runs, for every running sandbox; envd checks X-Access-Token itself.
    const ingressHandlers = new IngressPortHandlers();
    ingressHandlers.setPortHandler(ENVD_PORT, envdIngressHandler({ vms, tokens: envdTokens }), { auth: 'handler' });
    const app = await buildApp({
      logger: opts.httpLogger === false ? false : logger,
      apiKeys,
      metrics,
      bodyLimit: config.API_BODY_LIMIT_BYTES,
      metricsToken: config.METRICS_TOKEN,
      readiness: {
        checks: {
          event_store: () => store.ping(),
          database: async () => {
            await pool.query('SELECT 1');
          },
          projections: () => {
            const down = runner.status().filter((s) => !s.running);
            return down.length > 0
              ? Promise.reject(
                  new Error(`not running: ${down.map((s) => `${s.name}${s.lastError ? ` (${s.lastError})` : ''}`).join(', ')}`),
                )
              : Promise.resolve();
          },
          ...opts.readinessChecks,
        },
      },
      routes: [
        hostRoutes({ hosts, pool, runner, readYourWritesTimeoutMs: rywTimeout }),
        vmRoutes({
          vms,
          pool,
          runner,
          readYourWritesTimeoutMs: rywTimeout,
          store,
          limits: {
            fileMaxBytes: config.FILE_MAX_BYTES,
            // Inline files are up to 16 MiB decoded, sent as base64.
            createBodyLimit: Math.max(config.API_BODY_LIMIT_BYTES, 24 * 1024 * 1024),
            sessionsPerVm: config.WS_MAX_SESSIONS_PER_VM,
            sessionsPerTenant: config.WS_MAX_SESSIONS_PER_TENANT,
            attachIdleTimeoutMs: config.ATTACH_IDLE_TIMEOUT_MS,
          },
        }),
        vmHealthRoutes({ vms, pool }),
        networkRoutes({ vms }),
        tenantNetworkRoutes({ networks, pool, runner, readYourWritesTimeoutMs: rywTimeout }),
        deadLetterRoutes({
          reconciler,
          pool,
          runner,
          readYourWritesTimeoutMs: rywTimeout,
          isLeader: () => lease.held,
          intervalMs: config.RECONCILE_INTERVAL_MS,
        }),
        usageRoutes({ pool }),
        eventsRoutes({ store, logger, stats: feedStats, maxPerTenant: config.SSE_MAX_PER_TENANT }),
        auditRoutes({ store }),
        lifecycleRoutes({ lifecycle, pool, runner, readYourWritesTimeoutMs: rywTimeout }),
        snapshotRoutes({ snapshots, forkMigrate, pool, runner, readYourWritesTimeoutMs: rywTimeout }),
        e2bRoutes({
          apiKeys,
          vms,
          lifecycle,
          pool,
          runner,
          tokens: envdTokens,
          readYourWritesTimeoutMs: rywTimeout,
          memory: { memory, forkMigrate, snapshots, hosts },
        }),
        envdForwardRoutes({ vms, tokens: envdTokens }),
        ...(ingress ? [ingressRoutes({ ingress, vms })] : []),
        observeRoutes({ vms, hosts, maxFollowsPerCaller: config.SSE_MAX_PER_TENANT }),
        webhookRoutes({
          store,
          pool,
          secrets: secretBox,
          runner: webhooks.runner,
          allowPrivate: config.WEBHOOK_ALLOW_PRIVATE,
          maxPerTenant: config.WEBHOOK_MAX_PER_TENANT,
          readYourWritesTimeoutMs: rywTimeout,
        }),
        vmMemoryRoutes({ memory }),
      ],
    });
    closers.push(() => app.close());
    closers.push(() => forkMigrate.stop());
    if (config.RECONCILER_ENABLED) {
      closers.push(async () => {
        await lease.stop();
        await reconciler.stop();
      });
      lease.start();
      closers.push(() => snapshots.stop());
      closers.push(() => standby.stop());
    }
    return {
      app,
      store,
      runner,
      hosts,
      vms,
      reconciler,
      snapshots,
      standby,
      webhooks,
      isReconcilerLeader: () => lease.held,
      pool,
      ingress,
      ingressHandlers,
      recordIngressActivity: activityRecorder(handler, { correlationId: 'ingress-activity', actor: 'ingress' }),
      resumeVm: async (vmId, tenantId) => {
        await memory.resume(vmId, { correlationId: `ingress-wake-${vmId}`, tenantId, actor: 'ingress', admin: false });
      },
      close,
    };
  } catch (err) {
    await close();
    throw err;
  }
}

/** API keys from config: the admin key, then tenant keys. */
export function apiKeysFrom(adminKey: string, tenantKeys: ReadonlyArray<{ tenant: string; key: string }>): ApiKey[] {
  return [{ key: adminKey, tenant: ADMIN_TENANT, admin: true }, ...tenantKeys.map((k) => ({ key: k.key, tenant: k.tenant, admin: false }))];
}
