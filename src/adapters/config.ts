import { z } from 'zod';
import { egressRegistrySchema } from '../domain/egress/egress-registry.js';

/**
 * Configuration of the control plane, read once from the environment and
 * validated with zod. A bad value stops start-up with a message that names
 * the variable and says what to fix. Every variable is listed, with its
 * default, in README.md ("Configuration").
 */

/** The admin key's principal; never a tenant's id (see ApiKeys). */
export const ADMIN_TENANT = 'admin';

const bool = z.enum(['true', 'false', '1', '0', 'yes', 'no']).transform((v) => v === 'true' || v === '1' || v === 'yes');

const durationMs = z.coerce.number().int().nonnegative();

export const configSchema = z.object({
  HOST: z.string().min(1).default('127.0.0.1'),
  PORT: z.coerce.number().int().min(0).max(65535).default(8080),
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
  /** Where the embedded Postgres and generated secrets live. */
  DATA_DIR: z.string().min(1).default('.data'),
  /** External Postgres for read models (and events, unless EVENTSTORE_URL is set). Unset: the embedded server. */
  DATABASE_URL: z.url().optional(),
  /** `esdb://…`: EventStoreDB for events. */
  EVENTSTORE_URL: z
    .string()
    .regex(/^esdb(\+discover)?:\/\//, 'must be an esdb:// or esdb+discover:// connection string')
    .optional(),
  EMBEDDED_PG_PORT: z.coerce.number().int().min(1).max(65535).default(54329),
  /** Base64 of 32 bytes (AES-256-GCM). Unset: generated once into DATA_DIR/secrets.json. */
  TOKEN_ENCRYPTION_KEY: z
    .string()
    .refine((v) => Buffer.from(v, 'base64').length === 32, 'must be base64 of exactly 32 bytes (openssl rand -base64 32)')
    .optional(),
  /** Admin bearer key. Unset: generated once into DATA_DIR/secrets.json and printed at start. */
  ADMIN_API_KEY: z.string().min(16, 'must be at least 16 characters').optional(),
  /** Tenant keys as `tenant:key,tenant:key`. */
  API_KEYS: z
    .string()
    .default('')
    .transform((v, ctx) => {
      const out: Array<{ tenant: string; key: string }> = [];
      for (const part of v
        .split(',')
        .map((s) => s.trim())
        .filter(Boolean)) {
        const i = part.indexOf(':');
        const tenant = part.slice(0, i);
        const key = part.slice(i + 1);
        if (tenant === ADMIN_TENANT) {
          ctx.addIssue({
            code: 'custom',
            message: `entry "${ADMIN_TENANT}": the tenant id "${ADMIN_TENANT}" is reserved for the admin key (ADMIN_API_KEY); give this tenant another id`,
          });
          return z.NEVER;
        }
        if (i <= 0 || !/^[a-z0-9][a-z0-9_-]{0,62}$/.test(tenant) || key.length < 16) {
          // Named by its tenant or its place, never by its text: without a colon the whole entry may be a key.
          ctx.addIssue({
            code: 'custom',
            message: `entry ${i > 0 ? JSON.stringify(tenant) : `#${out.length + 1}`} must be tenant:key with a lowercase tenant id and a key of at least 16 characters`,
          });
          return z.NEVER;
        }
        out.push({ tenant, key });
      }
      return out;
    }),
  /** Start one local host agent (process backend) and register it. Default: on with the embedded default. */
  START_LOCAL_AGENT: bool.optional(),
  LOCAL_AGENT_PORT: z.coerce.number().int().min(1).max(65535).default(7070),
  PLACEMENT_POLICY: z.enum(['spread', 'binpack']).default('spread'),
  EXEC_DEFAULT_TIMEOUT_MS: durationMs.default(30_000),
  EXEC_MAX_TIMEOUT_MS: durationMs.default(600_000),
  STARTUP_SCRIPT_TIMEOUT_MS: durationMs.default(30_000),
  MAX_STARTUP_SCRIPT_TIMEOUT_MS: durationMs.default(50_000),
  AGENT_CALL_TIMEOUT_MS: durationMs.default(30_000),
  /** How long `?after=<position>` waits for the read models to catch up. */
  READ_YOUR_WRITES_TIMEOUT_MS: durationMs.default(5_000),
  /** Reconciler: one cycle over every host this often (seed FleetConfig.ReconcileInterval). */
  RECONCILE_INTERVAL_MS: z.coerce.number().int().min(100, 'at least 100 ms').default(30_000),
  /**
   * Standby checkpoints (seed CheckpointInterval): every interval each running VM on a CRIU host is checkpointed
   * live and the copy kept on one other CRIU host, so a live migrate there moves only the files that changed.
   * 0 (default) disables; otherwise at least 1 s (each tick freezes the VM for the dump).
   */
  CHECKPOINT_INTERVAL_MS: z.coerce
    .number()
    .int()
    .refine((v) => v === 0 || v >= 1000, '0 (off) or at least 1000 ms')
    .default(0),
  /** A running VM with no state change for this long is failed as stuck; a spec's max_runtime_s overrides it. 0 disables. */
  TASK_STUCK_TIMEOUT_MS: durationMs.default(2 * 60 * 60_000),
  /** Idle expiry (no exec, no attach) for VMs whose spec sets no idle_timeout_s. 0 (default) disables. */
  DEFAULT_IDLE_TIMEOUT_MS: durationMs.default(0),
  /** Consecutive failed destroys of an orphan before it is dead-lettered. */
  ORPHAN_DESTROY_MAX_RETRIES: z.coerce.number().int().min(1).max(1000).default(5),
  /** Consecutive reconcile cycles a host's agent may not answer before the host is marked unreachable. */
  HOST_UNREACHABLE_AFTER_CYCLES: z.coerce.number().int().min(1).max(1000).default(3),
  /** Age after which a VM left requested/placed/booting/destroying counts as abandoned by a crashed control plane. Keep above the slowest create. */
  RECONCILE_GRACE_MS: durationMs.default(5 * 60_000),
  /** Exec/attach activity is written to a VM's stream at most this often; idle expiry allows this much slack. */
  ACTIVITY_COALESCE_MS: durationMs.default(60_000),
  /** Per agent call made by the reconciler. */
  RECONCILE_AGENT_TIMEOUT_MS: z.coerce.number().int().min(100).default(10_000),
  /** Run the reconciler on this replica when it holds the lease. false: never (e.g. an API-only replica). */
  RECONCILER_ENABLED: bool.default(true),
  /** How often a standby replica tries to take the reconciler lease, and the holder checks it still has it. */
  LEASE_POLL_MS: z.coerce.number().int().min(50).default(1_000),
  /** Snapshots created without a retention window expire this long after creation. 0: kept until deleted. */
  DEFAULT_SNAPSHOT_RETENTION_MS: durationMs.default(0),
  /** Snapshots (creating/ready/restoring, build artifacts excluded) per tenant. 0 disables. */
  SNAPSHOT_QUOTA_MAX_COUNT: z.coerce.number().int().nonnegative().default(0),
  /** Aggregate bytes of those snapshots per tenant, checked against each one's expected size before it is archived. 0 disables. */
  SNAPSHOT_QUOTA_MAX_BYTES: z.coerce.number().int().nonnegative().default(0),
  /** Build (mode "build") snapshots per tenant, a pool apart from SNAPSHOT_QUOTA_*. 0 disables. */
  BUILD_SNAPSHOT_QUOTA_MAX_COUNT: z.coerce.number().int().nonnegative().default(0),
  /** Aggregate bytes of a tenant's build snapshots, checked like SNAPSHOT_QUOTA_MAX_BYTES. 0 disables. */
  BUILD_SNAPSHOT_QUOTA_MAX_BYTES: z.coerce.number().int().nonnegative().default(0),
  /** Bounds one host-to-host artifact transfer. 0: the agent call timeout. */
  ARTIFACT_PULL_TIMEOUT_MS: durationMs.default(0),
  /** Layer artifacts unused this long are collected. 0 (default) disables idle collection. */
  ARTIFACT_IDLE_TTL_MS: durationMs.default(0),
  /** Ready layer artifacts one tenant may keep; least recently used evicted. 0 disables. */
  ARTIFACT_MAX_PER_TENANT: z.coerce.number().int().nonnegative().default(0),
  /** How often the snapshot collector looks for expired snapshots and idle layers. */
  SNAPSHOT_GC_INTERVAL_MS: z.coerce.number().int().min(100, 'at least 100 ms').default(60_000),
  // ---- bounded resources at the edge (sec-http) ----
  /** Largest file GET/PUT /v1/vms/:id/files moves; a larger one is refused with 413 FILE_TOO_LARGE. */
  FILE_MAX_BYTES: z.coerce
    .number()
    .int()
    .min(1)
    .default(1024 * 1024 * 1024),
  /** Largest JSON (or text) request body; POST /v1/vms takes max(this, 24 MiB) for its inline files. */
  API_BODY_LIMIT_BYTES: z.coerce
    .number()
    .int()
    .min(1024, 'at least 1024')
    .default(1024 * 1024),
  /** Open exec/attach websockets per VM and per tenant (per replica); one more is refused with 429 TOO_MANY_SESSIONS. */
  WS_MAX_SESSIONS_PER_VM: z.coerce.number().int().min(1).default(8),
  WS_MAX_SESSIONS_PER_TENANT: z.coerce.number().int().min(1).default(32),
  /** An attach session with no frame in either direction for this long is closed (ATTACH_IDLE_TIMEOUT). 0 disables. */
  ATTACH_IDLE_TIMEOUT_MS: durationMs.default(30 * 60_000),
  /** Open GET /v1/events streams per tenant (per replica); one more is refused with 429 TOO_MANY_EVENT_STREAMS. */
  SSE_MAX_PER_TENANT: z.coerce.number().int().min(1).default(8),
  /** When set, /metrics needs `Authorization: Bearer <METRICS_TOKEN>` and /readyz shows its details to it. */
  METRICS_TOKEN: z.string().min(16, 'must be at least 16 characters').optional(),
  /**
   * vCPUs per CPU for hosts registered without their own capacity_overrides.cpu_overcommit_ratio.
   * Unset: 1 (no overcommit), except the embedded default's local host, registered at 4. RAM is never overcommitted.
   */
  CPU_OVERCOMMIT_RATIO: z.coerce.number().min(1, 'at least 1 (1: no overcommit)').max(64, 'at most 64').optional(),
  /**
   * Published URLs are `{INGRESS_SCHEME}://{port}-{vm_id}.{INGRESS_DOMAIN}`. Set: every exposed TCP port is published
   * through the ingress with a traffic token, and the VM's endpoints show those URLs. Unset: host-level endpoints, as before
   * (with the in-process ingress on, it defaults to localhost:<INGRESS_PORT>).
   */
  INGRESS_DOMAIN: z
    .string()
    .regex(
      /^[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::[0-9]{1,5})?$/i,
      'a host name with an optional :port, e.g. sbx.example.com or localhost:8081',
    )
    .optional(),
  INGRESS_SCHEME: z.enum(['http', 'https']).default('http'),
  /** Run the ingress proxy in this process. Default: on with the embedded default. */
  INGRESS_ENABLED: bool.optional(),
  INGRESS_HOST: z.string().min(1).default('127.0.0.1'),
  /** Unset: PORT + 1 (8081 by default), so a second control plane on another PORT does not collide. */
  INGRESS_PORT: z.coerce.number().int().min(0).max(65535).optional(),
  /** How long a proxy keeps a VM's route row before re-reading it (0: every request reads the table). */
  INGRESS_ROUTE_CACHE_MS: durationMs.default(1000),
  /** How long the first requests to a paused VM wait for the resume they trigger (in-process ingress only). */
  INGRESS_RESUME_TIMEOUT_MS: durationMs.default(60_000),
  // ---- webhooks (docs/webhooks.md) ----
  /** Let tenants' webhooks target loopback, private, link-local and reserved addresses (development, tests). */
  WEBHOOK_ALLOW_PRIVATE: bool.default(false),
  /** Failed attempts after which a delivery is dead (an operator may retry it). */
  WEBHOOK_MAX_ATTEMPTS: z.coerce.number().int().min(1).max(100).default(10),
  /** Backoff before the second attempt; doubles each time, jittered, capped at WEBHOOK_RETRY_MAX_MS. */
  WEBHOOK_RETRY_BASE_MS: z.coerce.number().int().min(10).default(5_000),
  WEBHOOK_RETRY_MAX_MS: z.coerce.number().int().min(10).default(3_600_000),
  /** One delivery's bound (connect to last byte of the answer's head). */
  WEBHOOK_TIMEOUT_MS: z.coerce.number().int().min(100).default(10_000),
  /** How often due deliveries are looked for. */
  WEBHOOK_DISPATCH_INTERVAL_MS: z.coerce.number().int().min(10).default(1_000),
  /** Webhooks per tenant. */
  WEBHOOK_MAX_PER_TENANT: z.coerce.number().int().min(1).default(16),
  /** Egress proxy providers, JSON: {"<name>": {"kind": "agent"}}. Unset: proxy-mode VMs are refused. */
  EGRESS_PROXIES: z
    .string()
    .transform((v, ctx) => {
      try {
        return JSON.parse(v) as unknown;
      } catch {
        ctx.addIssue({ code: 'custom', message: 'must be JSON, e.g. {"fleet":{"kind":"agent"}}' });
        return z.NEVER;
      }
    })
    .pipe(egressRegistrySchema)
    .optional(),
  /** Where tenant network subnets come from: must lie inside every process agent's AGENT_SUBNET (docs/networking.md). */
  NETWORK_POOL: z.cidrv4().default('10.88.192.0/18'),
  /** Size of a network subnet the caller did not name. */
  NETWORK_PREFIX_LEN: z.coerce.number().int().min(16).max(29).default(24),
});

export type Config = z.infer<typeof configSchema>;

export class ConfigError extends Error {
  constructor(readonly problems: string[]) {
    super(`invalid configuration:\n${problems.map((p) => `  - ${p}`).join('\n')}`);
    this.name = 'ConfigError';
  }
}

/** Parses a zod schema over an environment, naming each bad variable. Shared with the host agent's config. */
export function parseEnv<S extends z.ZodType>(schema: S, env: NodeJS.ProcessEnv): z.infer<S> {
  // An empty variable means "unset": `FOO= npm start` should not fail on FOO.
  const cleaned = Object.fromEntries(Object.entries(env).filter(([, v]) => v !== undefined && v !== ''));
  const result = schema.safeParse(cleaned);
  if (!result.success) {
    throw new ConfigError(
      result.error.issues.map((issue) => {
        const name = issue.path.join('.') || '(environment)';
        const value = cleaned[String(issue.path[0])];
        const shown = value === undefined ? '' : ` (got ${isSecretName(name) ? '<redacted>' : JSON.stringify(value)})`;
        return `${name}: ${issue.message}${shown}`;
      }),
    );
  }
  return result.data;
}

function isSecretName(name: string): boolean {
  // Connection strings carry credentials (postgres://user:pass@…, esdb://user:pass@…).
  return /KEY|TOKEN|SECRET|PASSWORD|DATABASE_URL|EVENTSTORE_URL/i.test(name);
}

export function loadConfig(env: NodeJS.ProcessEnv = process.env): Config {
  return parseEnv(configSchema, env);
}
