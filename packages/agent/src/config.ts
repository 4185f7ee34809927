import { z } from 'zod';
import { parseEgressRule } from '@fleet/agent-protocol';
import { randomBytes } from 'node:crypto';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';

/**
 * The host agent's configuration, read once from the environment. Same
 * shape of error as the control plane's config ("AGENT_PORT: must be …"),
 * but its own code: the agent is a separate program that shares only the
 * domain layer with the control plane.
 */

const bool = z
  .enum(['true', 'false', '1', '0', 'yes', 'no'], { error: 'must be true or false' })
  .transform((v) => v === 'true' || v === '1' || v === 'yes');
const commaList = z.string().transform((v) =>
  v
    .split(',')
    .map((x) => x.trim())
    .filter((x) => x !== ''),
);
const cidrList = commaList.pipe(
  z.array(
    z.string().refine((c) => {
      const r = parseEgressRule(c);
      return typeof r !== 'string' && r.kind === 'cidr';
    }, 'each entry an IPv4 CIDR, e.g. 10.20.0.0/16'),
  ),
);
const ipList = commaList.pipe(z.array(z.ipv4({ error: 'each entry an IPv4 address' })));
const positiveInt = (what: string) =>
  z.coerce
    .number({ error: `must be ${what}` })
    .int(`must be ${what}`)
    .positive(`must be ${what}`);

export const agentConfigSchema = z
  .object({
    AGENT_HOST: z.string().min(1).default('127.0.0.1'),
    AGENT_PORT: z.coerce
      .number({ error: 'must be a port number 0-65535' })
      .int()
      .min(0, 'must be a port number 0-65535')
      .max(65535, 'must be a port number 0-65535')
      .default(7070),
    AGENT_TOKEN: z
      .string({ error: 'is required: the bearer token the control plane presents (at least 16 characters)' })
      .min(16, 'must be at least 16 characters'),
    AGENT_DATA_DIR: z.string().min(1).default('.data/agent'),
    AGENT_IMAGE_DIR: z.string().min(1).optional(),
    AGENT_BACKEND: z.enum(['process', 'qemu'], { error: 'must be one of: process, qemu' }).default('process'),
    /** qemu backend: auto probes KVM (it must boot firmware in time) and falls back to TCG. */
    AGENT_QEMU_ACCEL: z.enum(['auto', 'kvm', 'tcg'], { error: 'must be one of: auto, kvm, tcg' }).default('auto'),
    /** qemu backend: bound on a boot until the in-guest agent answers. */
    AGENT_QEMU_BOOT_TIMEOUT_MS: positiveInt('a positive number of milliseconds').default(180_000),
    /** qemu backend: where the GPU probe reads sysfs (VFIO-bound PCI devices, mdevs) and the /dev holding vfio/<group>; tests point them at fixtures. */
    AGENT_SYSFS_ROOT: z.string().startsWith('/', 'must be an absolute path').default('/sys'),
    AGENT_DEV_ROOT: z.string().startsWith('/', 'must be an absolute path').default('/dev'),
    AGENT_SUBNET: z
      .string()
      .regex(/^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})\/(\d{1,2})$/, 'must be an IPv4 CIDR such as 10.88.0.0/16')
      .refine((v) => {
        const [ip, bits] = v.split('/') as [string, string];
        return ip.split('.').every((o) => Number(o) <= 255) && Number(bits) >= 8 && Number(bits) <= 28;
      }, 'must be an IPv4 CIDR with a prefix between /8 and /28')
      .default('10.88.0.0/16'),
    /** Names every bridge, veth and cgroup of this agent: two agents on one machine need distinct prefixes. */
    AGENT_BRIDGE_PREFIX: z
      .string()
      .regex(/^[a-z][a-z0-9]{0,4}$/, 'must be 1-5 lowercase letters or digits, starting with a letter')
      .default('fb'),
    /** Where published endpoints listen on the host. */
    AGENT_PUBLISH_HOST: z.string().min(1).default('127.0.0.1'),
    /** The image a create request that names none gets. */
    AGENT_DEFAULT_IMAGE: z
      .string()
      .regex(/^[a-z0-9][a-z0-9._-]{0,62}$/, 'must be an image name such as base')
      .default('base'),
    AGENT_LOG_LEVEL: z
      .enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'], {
        error: 'must be one of fatal, error, warn, info, debug, trace, silent',
      })
      .default('info'),
    AGENT_MAX_VMS: positiveInt('a positive integer').default(64),
    AGENT_EXEC_DEFAULT_TIMEOUT_MS: positiveInt('a positive number of milliseconds').default(30_000),
    AGENT_EXEC_MAX_TIMEOUT_MS: positiveInt('a positive number of milliseconds').default(600_000),
    /** Cap per stream (stdout, stderr) of a buffered exec. */
    AGENT_OUTPUT_CAP_BYTES: positiveInt('a positive number of bytes').default(1024 * 1024),
    AGENT_MAX_UPLOAD_BYTES: positiveInt('a positive number of bytes').default(1024 * 1024 * 1024),
    /** HMAC key for artifact grants. Unset: generated once into AGENT_DATA_DIR/grant-secret. */
    AGENT_GRANT_SECRET: z.string().min(32, 'must be at least 32 characters').optional(),
    AGENT_ALLOW_CROSS_TENANT: bool.default(false),
    /** Lowest host id handed to sandbox user namespaces (65536-id blocks at or above it). */
    AGENT_CONSOLE_LOG_MAX_BYTES: z.coerce
      .number()
      .int()
      .min(4096, 'at least 4096')
      .default(16 * 1024 * 1024),
    AGENT_UID_BASE: z.coerce
      .number({ error: 'must be a multiple of 65536' })
      .int()
      .min(65536)
      .max(2 ** 31)
      .multipleOf(65536, 'must be a multiple of 65536')
      .default(2 ** 28),
    /** Cap on one artifact pull from a peer. */
    AGENT_PULL_TIMEOUT_MS: positiveInt('a positive number of milliseconds').default(30 * 60_000),
    /** Sandbox monitor (backend/process/monitor.ts): sample interval, samples kept, OOM poll, console logs kept after a destroy. */
    AGENT_METRICS_INTERVAL_MS: z.coerce.number().int().min(100, 'at least 100').default(5000),
    AGENT_METRICS_WINDOW: z.coerce.number().int().min(1, 'at least 1').max(10_000, 'at most 10000').default(120),
    AGENT_OOM_POLL_MS: z.coerce.number().int().min(50, 'at least 50').default(1000),
    AGENT_LOG_RETENTION_MS: z.coerce.number().int().min(0, 'must be 0 or more').default(3_600_000),
    /** Port of the egress proxy this agent runs on its gateway address for proxy-mode sandboxes. */
    AGENT_EGRESS_PROXY_PORT: z.coerce.number().int().min(1, 'a port 1-65535').max(65535, 'a port 1-65535').default(3128),
    /** Private CIDRs (RFC 1918, CGNAT, ...) direct-mode sandboxes may reach by default, comma-separated. */
    AGENT_EGRESS_ALLOW_PRIVATE: cidrList.default([]),
    /** DNS servers (IPv4, comma-separated) the egress proxy resolves with; unset: the host's resolver. */
    AGENT_EGRESS_DNS: ipList.default([]),
    /** Sandbox disks kept formatted ahead of creates (process backend); 0: none. Each takes AGENT_DISK_POOL_GB of disk. */
    AGENT_DISK_POOL: z.coerce.number().int().min(0, 'must be 0 or more').max(64, 'at most 64').default(2),
    AGENT_DISK_POOL_GB: z.coerce.number().int().min(1, 'at least 1').max(64, 'at most 64').default(1),
    /**
     * Resumes, forks, moves and restores from this host's own checkpoint files run first and page their memory in
     * afterwards (criu lazy-pages over the local images) when the host can (capacity lazy_pages); false: every page
     * is read before the sandbox runs.
     */
    AGENT_LAZY_RESTORE: bool.default(true),
  })
  .refine((c) => c.AGENT_EXEC_DEFAULT_TIMEOUT_MS <= c.AGENT_EXEC_MAX_TIMEOUT_MS, {
    error: 'must not exceed AGENT_EXEC_MAX_TIMEOUT_MS',
    path: ['AGENT_EXEC_DEFAULT_TIMEOUT_MS'],
  });

type RawAgentConfig = z.infer<typeof agentConfigSchema>;

export interface AgentConfig {
  host: string;
  port: number;
  token: string;
  dataDir: string;
  imageDir: string;
  backend: 'process' | 'qemu';
  qemuAccel: 'auto' | 'kvm' | 'tcg';
  qemuBootTimeoutMs: number;
  sysfsRoot: string;
  devRoot: string;
  subnet: string;
  bridgePrefix: string;
  publishHost: string;
  defaultImage: string;
  logLevel: RawAgentConfig['AGENT_LOG_LEVEL'];
  maxVms: number;
  execDefaultTimeoutMs: number;
  execMaxTimeoutMs: number;
  outputCapBytes: number;
  maxUploadBytes: number;
  grantSecret: Buffer;
  allowCrossTenant: boolean;
  pullTimeoutMs: number;
  uidBase: number;
  consoleLogMaxBytes: number;
  metricsIntervalMs: number;
  metricsWindow: number;
  oomPollMs: number;
  logRetentionMs: number;
  egressProxyPort: number;
  egressAllowPrivate: string[];
  egressDnsServers: string[];
  diskPool: number;
  diskPoolGb: number;
  lazyRestore: boolean;
}

export class AgentConfigError extends Error {
  constructor(readonly problems: string[]) {
    super(`invalid host-agent configuration:\n${problems.map((p) => `  - ${p}`).join('\n')}`);
    this.name = 'AgentConfigError';
  }
}

const SECRET_NAME = /TOKEN|SECRET|KEY/i;

export function parseAgentEnv(env: Record<string, string | undefined>): RawAgentConfig {
  // An empty variable means "unset", as in the control plane's config.
  const cleaned = Object.fromEntries(Object.entries(env).filter(([k, v]) => k.startsWith('AGENT_') && v !== undefined && v !== ''));
  const result = agentConfigSchema.safeParse(cleaned);
  if (!result.success) {
    throw new AgentConfigError(
      result.error.issues.map((issue) => {
        const name = issue.path.join('.') || '(environment)';
        const value = cleaned[String(issue.path[0])];
        const shown = value === undefined ? '' : ` (got ${SECRET_NAME.test(name) ? '<redacted>' : JSON.stringify(value)})`;
        return `${name}: ${issue.message}${shown}`;
      }),
    );
  }
  return result.data;
}

/** Reads and validates the environment, creating the data dir and the grant secret if needed. */
export function loadAgentConfig(env: Record<string, string | undefined> = process.env): AgentConfig {
  const raw = parseAgentEnv(env);
  const dataDir = resolve(raw.AGENT_DATA_DIR);
  mkdirSync(dataDir, { recursive: true, mode: 0o700 });
  return {
    host: raw.AGENT_HOST,
    port: raw.AGENT_PORT,
    token: raw.AGENT_TOKEN,
    dataDir,
    imageDir: resolve(raw.AGENT_IMAGE_DIR ?? join(dataDir, 'images')),
    backend: raw.AGENT_BACKEND,
    qemuAccel: raw.AGENT_QEMU_ACCEL,
    qemuBootTimeoutMs: raw.AGENT_QEMU_BOOT_TIMEOUT_MS,
    sysfsRoot: raw.AGENT_SYSFS_ROOT,
    devRoot: raw.AGENT_DEV_ROOT,
    subnet: raw.AGENT_SUBNET,
    bridgePrefix: raw.AGENT_BRIDGE_PREFIX,
    publishHost: raw.AGENT_PUBLISH_HOST,
    defaultImage: raw.AGENT_DEFAULT_IMAGE,
    logLevel: raw.AGENT_LOG_LEVEL,
    maxVms: raw.AGENT_MAX_VMS,
    execDefaultTimeoutMs: raw.AGENT_EXEC_DEFAULT_TIMEOUT_MS,
    execMaxTimeoutMs: raw.AGENT_EXEC_MAX_TIMEOUT_MS,
    outputCapBytes: raw.AGENT_OUTPUT_CAP_BYTES,
    maxUploadBytes: raw.AGENT_MAX_UPLOAD_BYTES,
    grantSecret: raw.AGENT_GRANT_SECRET ? Buffer.from(raw.AGENT_GRANT_SECRET, 'utf8') : grantSecretFor(dataDir),
    allowCrossTenant: raw.AGENT_ALLOW_CROSS_TENANT,
    pullTimeoutMs: raw.AGENT_PULL_TIMEOUT_MS,
    uidBase: raw.AGENT_UID_BASE,
    consoleLogMaxBytes: raw.AGENT_CONSOLE_LOG_MAX_BYTES,
    metricsIntervalMs: raw.AGENT_METRICS_INTERVAL_MS,
    metricsWindow: raw.AGENT_METRICS_WINDOW,
    oomPollMs: raw.AGENT_OOM_POLL_MS,
    logRetentionMs: raw.AGENT_LOG_RETENTION_MS,
    egressProxyPort: raw.AGENT_EGRESS_PROXY_PORT,
    egressAllowPrivate: raw.AGENT_EGRESS_ALLOW_PRIVATE,
    egressDnsServers: raw.AGENT_EGRESS_DNS,
    diskPool: raw.AGENT_DISK_POOL,
    diskPoolGb: raw.AGENT_DISK_POOL_GB,
    lazyRestore: raw.AGENT_LAZY_RESTORE,
  };
}

/** The image directory alone, for `image build` (which needs no token). */
export function imageDirFromEnv(env: Record<string, string | undefined> = process.env): string {
  if (env.AGENT_IMAGE_DIR) return resolve(env.AGENT_IMAGE_DIR);
  return resolve(join(env.AGENT_DATA_DIR || '.data/agent', 'images'));
}

// Per data dir, so a restarted agent still honours grants it minted before.
function grantSecretFor(dataDir: string): Buffer {
  const file = join(dataDir, 'grant-secret');
  try {
    const existing = readFileSync(file);
    if (existing.length >= 32) return existing;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err;
  }
  const secret = randomBytes(32);
  writeFileSync(file, secret, { mode: 0o600 });
  return secret;
}
