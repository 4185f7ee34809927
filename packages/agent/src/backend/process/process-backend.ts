import { spawn } from 'node:child_process';
import { closeSync, existsSync, fchownSync } from 'node:fs';
import { chmod, mkdir, readdir, readFile, readlink, rename, rm, writeFile } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { dirname, join, resolve } from 'node:path';
import { Transform, type Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { Logger } from 'pino';
import { z } from 'zod';
import { AppError, describeFields, dottedPath, fieldsFromZod } from '@fleet/agent-protocol';
import type { HostCapacity } from '@fleet/agent-protocol';
import {
  capacityExhausted,
  featureMissing,
  invalidSpec,
  sandboxExists,
  sandboxFailed,
  sandboxNotFound,
  sandboxNotRunning,
  type Backend,
  type Checkpoint,
  type CheckpointOptions,
  type CreateSpec,
  type DestroyOptions,
  type Endpoint,
  type NetworkReassertReport,
  type ProcessHandle,
  type PruneReport,
  type SandboxInfo,
  type SpawnOptions,
} from '../../backend.js';
import { resolveImage } from '../../images.js';
import { probeCapacity, withoutDevices } from '../host-capacity.js';
import { Cgroups } from './cgroups.js';
import { CheckpointStore, expectedArchiveBytes } from './checkpoints.js';
import { KeyedMutex, mustRun, processStartTime, runTool, sleep } from './exec-util.js';
import {
  CRIU_META,
  criuMetaSchema,
  detectCriu,
  dumpTree,
  installNetnsHook,
  restoreTree,
  type CriuFeatures,
  type CriuMeta,
} from './criu.js';
import { resolveInRoot } from './guest-path.js';
import { Spawner, spawnPiped, spawnPty } from './guest-process.js';
import { enterArgv, findHostTools, launchInit, openConsoleWriter, USERNS_SIZE, type EnterOp, type HostTools } from './launch.js';
import { encodeGuestEnv, ensureSandboxHelper } from '../../native/helper.js';
import { Firewall, type FirewallState } from './firewall.js';
import {
  allocateBridge,
  allocateVeth,
  attachSandbox,
  bridgeForwarding,
  deleteLink,
  detachSandbox,
  ensureBridge,
  hardenLink,
  listLinks,
  listRoutes,
  parseSubnet,
  reserve,
  type Subnet,
} from './network.js';
import { startProxy, type Proxy } from './proxy.js';
import { SandboxMonitor } from './monitor.js';
import { monitorOptionsSchema } from './monitor-options.js';
import { EgressHost, forwards, usesAgentProxy } from './egress-host.js';
import { NO_EGRESS, sandboxEgressSchema, type SandboxEgress } from './egress.js';
import {
  createDisk,
  DISK_IMAGE,
  DISK_MOUNT,
  layerDirs,
  layerUsage,
  mountDisk,
  mountPoints,
  pruneLoopDevices,
  removeDisk,
  requireDiskTools,
  type LayerUsage,
} from './storage.js';
import { envKeyRe, exposeSchema, nameRe, tenantRe } from '../spec-rules.js';

/**
 * The `process` backend: each sandbox is a set of Linux namespaces (pid,
 * mount, uts, ipc, net) around an overlayfs root (read-only image + its own
 * writable layer), on a per-tenant bridge, limited by cgroups. See
 * launch.ts (start, capabilities), network.ts (isolation), cgroups.ts,
 * checkpoints.ts. Everything a restarted agent needs is on disk:
 *
 *   <dataDir>/sandboxes/<name>/state.json   what was created, init pid + start time
 *   <dataDir>/sandboxes/<name>/disk.img     the sandbox's own ext4 disk (storage_gb), mounted at disk/ (storage.ts)
 *   <dataDir>/sandboxes/<name>/disk/upper/  the writable layer (what a checkpoint archives; upper/ without a disk)
 *   <dataDir>/sandboxes/<name>/disk/work/   overlayfs work dir
 *   <dataDir>/sandboxes/<name>/root/        mount point (mounted only inside the sandbox's mount namespace)
 *   <dataDir>/sandboxes/<name>/console.log  serial-style log of the init's output
 */

export const optionsSchema = z.object({
  dataDir: z.string().min(1),
  imageDir: z.string().min(1),
  subnet: z.string().default('10.213.0.0/16'),
  bridgePrefix: z
    .string()
    .regex(/^[a-z][a-z0-9]{0,4}$/, 'bridgePrefix must be 1-5 of [a-z0-9], starting with a letter')
    .default('fb'),
  maxSandboxes: z.number().int().positive().default(64),
  allowCrossTenant: z.boolean().default(false),
  publishHost: z.string().default('127.0.0.1'),
  /** Host written into endpoint URLs; default publishHost (127.0.0.1 when publishing on 0.0.0.0). */
  advertiseHost: z.string().optional(),
  defaultImage: z.string().default('base'),
  defaultPidsMax: z.number().int().positive().default(1024),
  busybox: z.string().default('/bin/busybox'),
  cgroupRoot: z.string().default('/sys/fs/cgroup'),
  /** TTY implementation: node-pty when installed, else script(1); 'script' forces the fallback. */
  pty: z.enum(['auto', 'script']).default('auto'),
  /**
   * Host ids for sandbox user namespaces: each sandbox gets its own block of
   * 65536 ids, picked at random among the free blocks in [uidBase, 2^32).
   */
  uidBase: z
    .number()
    .int()
    .min(USERNS_SIZE)
    .max(2 ** 31)
    .multipleOf(USERNS_SIZE)
    .default(2 ** 28),
  /** The console log lives on the data dir's filesystem, outside the sandbox's disk: at most this many bytes of it are kept. */
  consoleLogMaxBytes: z
    .number()
    .int()
    .min(4096)
    .default(16 * 1024 * 1024),
  ...monitorOptionsSchema.shape,
  /** Port of the agent's egress proxy on the gateway address (proxy-mode sandboxes). */
  egressProxyPort: z.number().int().min(1).max(65535).default(3128),
  /** Private CIDRs direct-mode sandboxes may reach without an allow_out of their own. */
  egressAllowPrivate: z.array(z.string()).default([]),
  /** DNS servers the egress proxy resolves names with; empty: the host's resolver. */
  egressDnsServers: z.array(z.string()).default([]),
});
export type ProcessBackendOptions = z.input<typeof optionsSchema> & { logger?: Logger };

const createSpecSchema = z.object({
  name: z.string().regex(nameRe, 'a sandbox name is 1-63 of [a-z0-9-], starting with a letter or digit'),
  image: z.string().min(1).optional(),
  checkpointId: z.string().min(1).optional(),
  cpus: z.number().positive().max(1024),
  ram_mb: z
    .number()
    .int()
    .min(16, 'at least 16 MiB')
    .max(16 * 1024 * 1024),
  pids_max: z.number().int().min(8).max(4_194_304).optional(),
  /** GiB of the sandbox's own disk (its writable layer); 0: no disk of its own. */
  storage_gb: z.number().int().min(0).max(65536).optional(),
  tenant: z.string().regex(tenantRe, 'a tenant id is 1-63 of [a-z0-9_-], starting with a letter or digit'),
  ipHint: z.string().optional(),
  resume: z.boolean().optional(),
  expose: z.array(exposeSchema).max(64).optional(),
  env: z
    .record(
      z.string().regex(envKeyRe, 'an environment variable name'),
      z.string().refine((v) => !v.includes('\0'), 'no NUL bytes'),
    )
    .optional(),
  /** Keep CAP_NET_RAW (raw sockets: ping, packet capture); dropped by default. */
  net_raw: z.boolean().optional(),
  egress: sandboxEgressSchema.optional(),
});

const persistedSchema = z.object({
  version: z.literal(1),
  name: z.string(),
  status: z.enum(['creating', 'running', 'paused']),
  tenant: z.string(),
  image: z.string(),
  checkpoint_id: z.string(),
  ip: z.string(),
  mac: z.string(),
  bridge: z.string(),
  veth: z.string(),
  cpus: z.number(),
  ram_mb: z.number(),
  pids_max: z.number(),
  /** Absent in state written before sandboxes had disks: 0, the layer in upper/. */
  storage_gb: z.number().int().nonnegative().default(0),
  created_at: z.string(),
  init_pid: z.number(),
  init_start: z.string(),
  env: z.record(z.string(), z.string()),
  net_raw: z.boolean().default(false),
  /** Host id of the sandbox's root (user namespace); 0: a sandbox from before user namespaces. */
  uid_base: z.number().int().nonnegative().default(0),
  expose: z.array(exposeSchema),
  /** Host port per expose entry (same order), so a restarted agent republishes on the same ports. */
  host_ports: z.array(z.number()),
  /** Absent in state written before egress: none, what those sandboxes had. */
  egress: sandboxEgressSchema.default(NO_EGRESS),
  /** While paused: the memory checkpoint its processes are in (resume restores it). */
  paused_checkpoint: z.string().default(''),
});
type Persisted = z.output<typeof persistedSchema>;

interface SandboxRecord {
  state: Persisted;
  proxies: Proxy[];
}

const DEFAULT_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

/** Linux's MAX_ARG_STRLEN (32 pages), NUL included. */
const MAX_ARG_STRLEN = 32 * 4096;
/** Well under ARG_MAX (a quarter of the 8 MiB default stack), pointers included. */
const MAX_EXEC_BYTES = 1024 * 1024;

/**
 * The helper's exec carries argv and the hex-encoded guest environment (twice
 * the bytes): over the kernel's limits it fails with E2BIG, which is the
 * caller's input, so a 400 naming the limit rather than a failed exec.
 */
function checkExecSize(argv: readonly string[], hostEnv: Record<string, string>): Record<string, string> {
  let total = 0;
  for (const [what, s] of [
    ...argv.map((a) => ['argv', a] as const),
    ...Object.entries(hostEnv).map(([k, v]) => ['env', `${k}=${v}`] as const),
  ]) {
    const bytes = Buffer.byteLength(s) + 1;
    if (bytes > MAX_ARG_STRLEN) {
      throw invalidSpec(
        `an ${what} entry is too long: at most ${what === 'env' ? Math.floor((MAX_ARG_STRLEN - 16) / 2) : MAX_ARG_STRLEN - 1} bytes each`,
        [{ path: what, message: 'entry too long' }],
      );
    }
    total += bytes + 8;
  }
  if (total > MAX_EXEC_BYTES)
    throw invalidSpec(`argv and env together are too large: at most about ${MAX_EXEC_BYTES / 2} bytes of environment`, [
      { path: 'env', message: 'too large' },
    ]);
  return hostEnv;
}

export class ProcessBackend implements Backend {
  readonly kind = 'process' as const;
  private readonly records = new Map<string, SandboxRecord>();
  private readonly locks = new KeyedMutex();
  private readonly bridgesReady = new Set<string>();
  private readonly checkpoints: CheckpointStore;
  private readonly sandboxesDir: string;
  private closed = false;
  private saidLeftOut = false;
  private spawner: Spawner | null = null;
  /** Metrics, OOM kills and kept console logs (monitor.ts). */
  readonly observer: SandboxMonitor;
  private readonly egress: EgressHost;
  private criu: CriuFeatures | null = null;
  private criuHook = '';
  /** Staging entries a dump or restore is using now: prune leaves them. */
  private readonly scratch = new Set<string>();

  private constructor(
    private readonly opts: z.output<typeof optionsSchema>,
    private readonly subnet: Subnet,
    private readonly cgroups: Cgroups,
    private readonly tools: HostTools,
    private readonly firewall: Firewall,
    private readonly log: Logger | undefined,
  ) {
    this.sandboxesDir = join(opts.dataDir, 'sandboxes');
    this.checkpoints = new CheckpointStore(join(opts.dataDir, 'checkpoints'), join(opts.dataDir, 'staging'));
    this.observer = new SandboxMonitor({
      cgroups,
      intervalMs: opts.metricsIntervalMs,
      window: opts.metricsWindow,
      oomPollMs: opts.oomPollMs,
      logsDir: join(opts.dataDir, 'logs'),
      logRetentionMs: opts.logRetentionMs,
      log,
      sandboxDirOf: (name) => this.sandboxDir(name),
      targets: () =>
        [...this.records.values()]
          .filter((r) => r.state.status === 'running' && r.state.init_pid > 0)
          .map((r) => ({
            name: r.state.name,
            initPid: r.state.init_pid,
            initStart: r.state.init_start,
            veth: r.state.veth,
            ramMb: r.state.ram_mb,
            sandboxDir: this.sandboxDir(r.state.name),
            storageGb: r.state.storage_gb,
          })),
    });
    this.egress = new EgressHost(
      { subnet: subnet.cidr, gateway: subnet.gateway, proxyPort: opts.egressProxyPort, allowPrivate: opts.egressAllowPrivate },
      (ip) => this.proxyPolicyOf(ip),
      opts.egressDnsServers,
      log,
    );
  }

  /** Checks the host (tools, overlayfs, cgroups), creates the data directories and recovers surviving sandboxes. */
  static async open(options: ProcessBackendOptions): Promise<ProcessBackend> {
    const { logger, ...rest } = options;
    const parsed = optionsSchema.safeParse(rest);
    if (!parsed.success) {
      throw invalidSpec(`invalid process backend options: ${describeFields(fieldsFromZod(parsed.error))}`);
    }
    // Absolute paths: they go into mount options and are compared with /proc/self/mountinfo.
    const opts = { ...parsed.data, dataDir: resolve(parsed.data.dataDir), imageDir: resolve(parsed.data.imageDir) };
    const subnet = parseSubnet(opts.subnet);
    await assertHostFeatures();
    await mkdir(opts.dataDir, { recursive: true, mode: 0o700 });
    requireDiskTools();
    const tools: HostTools = { ...findHostTools(opts.busybox), helper: await ensureSandboxHelper(opts.dataDir) };
    const cgroups = Cgroups.detect(`fleet-${opts.bridgePrefix}`, opts.cgroupRoot);
    await cgroups.verify();
    await mkdir(opts.dataDir, { recursive: true, mode: 0o700 });
    // Closed to host users whatever the data dir's mode: a layer holds files owned by on-disk id 0 (sandbox root),
    // set-uid ones included when the sandbox has no disk of its own (no nosuid mount under them).
    await mkdir(join(opts.dataDir, 'sandboxes'), { recursive: true, mode: 0o700 });
    await chmod(join(opts.dataDir, 'sandboxes'), 0o700);
    await mkdir(opts.imageDir, { recursive: true });
    const firewall = await Firewall.open(opts.bridgePrefix);
    const backend = new ProcessBackend(opts, subnet, cgroups, tools, firewall, logger);
    await backend.checkpoints.init();
    const found = await detectCriu();
    backend.criu = found.features;
    if (found.features) {
      backend.criuHook = await installNetnsHook(join(opts.dataDir, 'runtime-helper'));
      logger?.info(
        { criu: found.features.path, version: found.features.version, notes: found.features.notes },
        'criu found: memory checkpoints on',
      );
    } else logger?.info({ reason: found.reason }, 'no usable criu: checkpoints are disk only');
    await backend.recover();
    backend.spawner = await Spawner.start(tools.helper, join(opts.dataDir, 'exec.sock'), (err) =>
      logger?.warn({ err }, 'exec spawner'),
    ).catch((err: unknown) => {
      logger?.warn({ err }, 'the exec spawner did not start: every exec spawns the helper');
      return null;
    });
    backend.observer.start();
    return backend;
  }

  get cgroupVersion(): 1 | 2 {
    return this.cgroups.version;
  }

  /** Kernel-reported limits of a sandbox's cgroup (diagnostics and tests). */
  async cgroupLimits(name: string): ReturnType<Cgroups['readLimits']> {
    this.must(name);
    return this.cgroups.readLimits(name);
  }

  sandboxDir(name: string): string {
    return join(this.sandboxesDir, name);
  }

  async capacity(): Promise<HostCapacity> {
    const { capacity: cap, leftOut } = withoutDevices(
      await probeCapacity({ dataDir: this.opts.dataDir, maxSandboxes: this.opts.maxSandboxes }),
    );
    if (leftOut.length > 0 && !this.saidLeftOut) {
      this.saidLeftOut = true;
      this.log?.warn(
        { left_out: leftOut },
        `this host has ${leftOut.join(' and ')}: the process backend cannot pass devices through, so they are not offered (a qemu host can)`,
      );
    }
    // Sandbox disks are preallocated, so free space already lacks them, and placement subtracts each VM's storage_gb
    // again: a probe while sandboxes run must not count them twice. A paused sandbox has no reservation: its disk stays
    // counted here, as used space.
    const held = [...this.records.values()].filter((r) => r.state.status !== 'paused').reduce((n, r) => n + r.state.storage_gb, 0);
    return {
      ...cap,
      storage_gb: cap.storage_gb + held,
      live_snapshot: this.criu?.liveSnapshot ?? false,
      lazy_pages: this.criu?.lazyPages ?? false,
      memory_diff: this.criu?.memoryDiff ?? false,
    };
  }

  async create(input: CreateSpec): Promise<SandboxInfo> {
    this.assertOpen();
    const parsed = createSpecSchema.safeParse(input);
    if (!parsed.success) {
      throw invalidSpec(
        `invalid sandbox spec: ${describeFields(fieldsFromZod(parsed.error, (p) => dottedPath(p) || '(spec)'))}`,
        fieldsFromZod(parsed.error),
      );
    }
    const spec = parsed.data;
    return this.locks.run(`sb:${spec.name}`, async () => {
      let image = spec.image ?? this.opts.defaultImage;
      let checkpointId = '';
      if (spec.checkpointId) {
        const cp = await this.checkpoints.get(spec.checkpointId);
        if (spec.image && spec.image !== cp.image) {
          throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", not "${spec.image}": omit image or name the checkpoint's`, [
            { path: 'image', message: 'conflicts with the checkpoint' },
          ]);
        }
        image = cp.image;
        checkpointId = cp.id;
        if (spec.resume) {
          this.requireCriu();
          if (cp.kind !== 'live') {
            throw new AppError('CHECKPOINT_NOT_LIVE', 409, `checkpoint "${cp.id}" holds no memory: it can boot a sandbox, not resume one`, {
              id: cp.id,
            });
          }
        }
      } else if (spec.resume) {
        throw invalidSpec('resume needs a checkpointId (a live checkpoint)', [{ path: 'resume', message: 'needs checkpointId' }]);
      }
      const imagePath = await resolveImage(this.opts.imageDir, image);
      // From here to records.set nothing awaits: the name, the slot and the address are taken atomically.
      if (this.records.has(spec.name)) throw sandboxExists(spec.name);
      if (this.records.size >= this.opts.maxSandboxes) {
        throw capacityExhausted(`${this.records.size} of ${this.opts.maxSandboxes} sandboxes are in use`, { max: this.opts.maxSandboxes });
      }
      const taken = new Set([...this.records.values()].map((r) => r.state.ip));
      const { ip, mac } = reserve(this.subnet, spec.name, spec.ipHint, taken);
      const state: Persisted = {
        version: 1,
        name: spec.name,
        status: 'creating',
        tenant: spec.tenant,
        image,
        checkpoint_id: checkpointId,
        ip,
        mac,
        bridge: allocateBridge(
          this.opts.bridgePrefix,
          spec.tenant,
          this.opts.allowCrossTenant,
          [...this.records.values()].map((r) => r.state),
        ),
        veth: allocateVeth(
          this.opts.bridgePrefix,
          [...this.records.values()].map((r) => r.state.veth),
        ),
        cpus: spec.cpus,
        ram_mb: spec.ram_mb,
        pids_max: spec.pids_max ?? this.opts.defaultPidsMax,
        storage_gb: spec.storage_gb ?? 0,
        created_at: new Date().toISOString(),
        init_pid: 0,
        init_start: '',
        env: spec.env ?? {},
        net_raw: spec.net_raw ?? false,
        uid_base: this.pickUidBase(),
        expose: spec.expose ?? [],
        host_ports: [],
        egress: spec.egress ?? NO_EGRESS,
        paused_checkpoint: '',
      };
      Object.assign(state.env, this.egress.guestEnv(state.egress, ip));
      const record: SandboxRecord = { state, proxies: [] };
      this.records.set(spec.name, record);
      const t0 = performance.now();
      const phases: Record<string, number> = {};
      const mark = (phase: string): void => {
        phases[phase] = Math.round((performance.now() - t0) * 10) / 10;
      };
      // Started now, awaited before the bridge and veth exist: nft runs while the directories and cgroup are made.
      const firewallReady = this.firewall.apply(() => this.firewallState());
      firewallReady.catch(() => undefined);
      try {
        const dir = this.sandboxDir(spec.name);
        // A directory nobody owns (a crash between mkdir and state.json) is garbage.
        if (existsSync(join(dir, DISK_IMAGE))) await removeDisk(dir);
        await rm(dir, { recursive: true, force: true });
        await mkdir(join(dir, 'root'), { recursive: true });
        await this.persist(state);
        const layer = layerDirs(dir, state.storage_gb);
        if (state.storage_gb > 0) await createDisk(dir, state.storage_gb);
        else for (const d of [layer.upper, layer.work]) await mkdir(d, { recursive: true });
        mark('dirs');
        if (checkpointId) await this.checkpoints.extract(checkpointId, layer.upper);
        await this.cgroups.create(spec.name, { cpus: state.cpus, ramMb: state.ram_mb, pidsMax: state.pids_max });
        mark('cgroup');
        // The rules for this sandbox's bridge and port exist before either does.
        await firewallReady;
        mark('firewall');
        // Three ip(8) runs cost tens of ms on a busy host: readyBridge skips them for a bridge this process set up.
        await this.readyBridge(record);
        await this.syncBridgeForwarding(state.bridge);
        if (usesAgentProxy(state.egress)) await this.egress.ensureProxy();
        mark('bridge');
        if (spec.resume) await this.restoreInto(record, await this.checkpoints.get(checkpointId));
        else await this.launch(record, imagePath);
        mark('init');
        await this.persist(state);
        mark('network');
        await this.publish(record);
        state.status = 'running';
        await this.persist(state);
        mark('done');
      } catch (err) {
        await this.teardown(record, {}).catch((e: unknown) =>
          this.log?.warn({ err: e, sandbox: spec.name }, 'cleanup after a failed create failed'),
        );
        throw err instanceof AppError
          ? err
          : sandboxFailed(`creating sandbox "${spec.name}" failed: ${(err as Error).message}`, { name: spec.name }, err);
      }
      this.log?.info({ sandbox: spec.name, ip, image, checkpoint: checkpointId || undefined }, 'sandbox created');
      this.log?.debug({ sandbox: spec.name, phases_ms: phases }, 'create timings');
      return this.info(record);
    });
  }

  async get(name: string): Promise<SandboxInfo> {
    const r = this.records.get(name);
    // A paused sandbox exists (its disk, its checkpoint): it can be read and destroyed, not entered.
    if (r?.state.status === 'paused') return this.info(r);
    return this.info(this.must(name));
  }

  async list(prefix = ''): Promise<SandboxInfo[]> {
    const out: SandboxInfo[] = [];
    for (const r of this.records.values()) {
      if (r.state.status !== 'creating' && r.state.name.startsWith(prefix)) out.push(await this.info(r));
    }
    return out.sort((a, b) => a.name.localeCompare(b.name));
  }

  async destroy(name: string, opts: DestroyOptions = {}): Promise<void> {
    if (!nameRe.test(name)) return;
    await this.locks.run(`sb:${name}`, async () => {
      let record = this.records.get(name);
      if (!record) {
        const state = await this.readState(name);
        if (!state) {
          await rm(this.sandboxDir(name), { recursive: true, force: true });
          return;
        }
        record = { state, proxies: [] };
      }
      await this.teardown(record, opts);
      this.log?.info({ sandbox: name }, 'sandbox destroyed');
    });
  }

  async spawn(name: string, opts: SpawnOptions): Promise<ProcessHandle> {
    const record = this.must(name);
    if (!Array.isArray(opts.argv) || opts.argv.length === 0 || opts.argv.some((a) => typeof a !== 'string' || a.includes('\0'))) {
      throw invalidSpec('argv must be a non-empty list of strings without NUL bytes', [{ path: 'argv', message: 'invalid argv' }]);
    }
    const env: Record<string, string> = { PATH: DEFAULT_PATH, HOME: '/root', HOSTNAME: name, ...record.state.env, ...(opts.env ?? {}) };
    for (const [k, v] of Object.entries(env)) {
      if (!envKeyRe.test(k) || v.includes('\0'))
        throw invalidSpec(`environment variable "${k}" is invalid`, [{ path: `env.${k}`, message: 'invalid name or value' }]);
    }
    const cwd = opts.cwd ?? '/';
    if (!cwd.startsWith('/') || cwd.includes('\0'))
      throw invalidSpec('cwd must be an absolute guest path', [{ path: 'cwd', message: 'must start with /' }]);
    if (opts.tty) {
      if (env.TERM === undefined) env.TERM = 'xterm-256color';
      const size = { rows: clampSize(opts.tty.rows, 24), cols: clampSize(opts.tty.cols, 80) };
      const argv = await this.enter(record, { op: 'exec', argv: opts.argv }, cwd, size);
      return spawnPty(argv, checkExecSize(argv, encodeGuestEnv(env)), size, this.opts.pty);
    }
    const argv = await this.enter(record, { op: 'exec', argv: opts.argv }, cwd);
    const hostEnv = checkExecSize(argv, encodeGuestEnv(env));
    if (this.spawner?.ready) return this.spawner.spawn(argv.slice(1), hostEnv, opts.stdin);
    return spawnPiped(argv, hostEnv, opts.stdin);
  }

  /** The helper's argv for `op` inside a running sandbox (its host environment is fixed: see spawnPiped). */
  private async enter(record: SandboxRecord, op: EnterOp, cwd = '/', winsize?: { rows: number; cols: number }): Promise<string[]> {
    await this.assertRunning(record);
    const s = record.state;
    return enterArgv({
      initPid: s.init_pid,
      initStart: s.init_start,
      cgroupProcs: this.cgroups.procsFiles(s.name),
      cwd,
      netRaw: s.net_raw,
      ...(winsize ? { winsize } : {}),
      op,
      tools: this.tools,
    });
  }

  async resolveGuestPath(name: string, guestPath: string, opts: { forWrite: boolean }): Promise<string> {
    const record = this.must(name);
    await this.assertRunning(record);
    const { hostPath } = await resolveInRoot(`/proc/${record.state.init_pid}/root`, guestPath, opts);
    return hostPath;
  }

  async writeGuestFile(
    name: string,
    guestPath: string,
    data: Readable,
    opts: { mode?: number; maxBytes?: number } = {},
  ): Promise<{ path: string; bytes: number }> {
    const record = this.must(name);
    await this.assertRunning(record);
    const resolved = await resolveInRoot(`/proc/${record.state.init_pid}/root`, guestPath, { forWrite: true });
    const mode = (opts.mode ?? 0o644).toString(8);
    if (!/^[0-7]{1,4}$/.test(mode))
      throw invalidSpec(`file mode ${mode} is invalid: use octal permission bits`, [{ path: 'mode', message: 'invalid mode' }]);
    // Done by the helper inside the sandbox, as its root: the rename happens in the guest's view of its root.
    const tmp = `${resolved.guestPath}.upload-${randomBytes(6).toString('hex')}`;
    const h = spawnPiped(await this.enter(record, { op: 'put', path: resolved.guestPath, mode, tmp }), {}, true);
    let bytes = 0;
    // Set inside the transform below, read after the pipeline: a field, so the compiler does not narrow it to false.
    const over = { tooLarge: false };
    let stderr = '';
    h.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
    h.stdout.resume();
    const counter = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        bytes += chunk.length;
        if (opts.maxBytes !== undefined && bytes > opts.maxBytes) {
          over.tooLarge = true;
          // Killed before its stdin closes: an end of input would commit the partial file.
          h.kill('SIGKILL');
          cb(new Error('too large'));
        } else cb(null, chunk);
      },
    });
    // A cut transfer must not look finished: the writer is killed before the pipe closes, as its EOF would commit the partial file.
    const killNow = (): void => h.kill('SIGKILL');
    data.once('aborted', killNow);
    data.once('error', killNow);
    let pipeErr: unknown;
    try {
      await pipeline(data, counter, h.stdin);
    } catch (err) {
      pipeErr = err;
      // Killing the group leaves the temp file: remove it from inside below.
      h.kill('SIGKILL');
    }
    const st = await h.wait();
    if (over.tooLarge || pipeErr !== undefined || st.exitCode !== 0) {
      if (pipeErr !== undefined) {
        await this.enter(record, { op: 'unlink', path: tmp })
          .then((argv) => {
            const c = spawnPiped(argv, {}, false);
            c.stdout.resume();
            c.stderr.resume();
            return c.wait();
          })
          .catch(() => undefined);
      }
      if (over.tooLarge)
        throw new AppError('PAYLOAD_TOO_LARGE', 413, `the file is larger than ${opts.maxBytes} bytes`, { path: resolved.guestPath });
      if (st.exitCode === 21)
        throw new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${resolved.guestPath}" is a directory in the sandbox; give a file path`, {
          path: resolved.guestPath,
        });
      if (pipeErr !== undefined)
        throw pipeErr instanceof AppError
          ? pipeErr
          : sandboxFailed(`writing "${resolved.guestPath}" failed: ${(pipeErr as Error).message}`, { path: resolved.guestPath }, pipeErr);
      throw sandboxFailed(
        `writing "${resolved.guestPath}" in the sandbox failed: ${stderr.trim().slice(0, 300) || `exit ${st.exitCode}`}`,
        { path: resolved.guestPath },
      );
    }
    return { path: resolved.guestPath, bytes };
  }

  async readGuestFile(name: string, guestPath: string): Promise<{ path: string; size: number; stream: Readable; done: Promise<void> }> {
    const record = this.must(name);
    await this.assertRunning(record);
    const resolved = await resolveInRoot(`/proc/${record.state.init_pid}/root`, guestPath, { forWrite: false });
    // First line: the size, from the same process that then streams the bytes.
    const h = spawnPiped(await this.enter(record, { op: 'get', path: resolved.guestPath }), {}, false);
    let stderr = '';
    h.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
    const size = await new Promise<number>((resolve, reject) => {
      let head = Buffer.alloc(0);
      const onData = (chunk: Buffer): void => {
        head = Buffer.concat([head, chunk]);
        const nl = head.indexOf(10);
        if (nl < 0) return;
        h.stdout.off('data', onData);
        h.stdout.pause();
        const rest = head.subarray(nl + 1);
        if (rest.length > 0) h.stdout.unshift(rest);
        resolve(Number(head.subarray(0, nl).toString()));
      };
      h.stdout.on('data', onData);
      h.wait().then((st) => {
        if (st.exitCode === 21)
          reject(
            new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${resolved.guestPath}" is not a regular file in the sandbox`, {
              path: resolved.guestPath,
            }),
          );
        else
          reject(
            sandboxFailed(`reading "${resolved.guestPath}" failed: ${stderr.trim().slice(0, 300) || `exit ${st.exitCode}`}`, {
              path: resolved.guestPath,
            }),
          );
      }, reject);
    });
    const done = h.wait().then((st) => {
      if (st.exitCode !== 0)
        throw sandboxFailed(`reading "${resolved.guestPath}" failed part-way: ${stderr.trim().slice(0, 300) || `exit ${st.exitCode}`}`, {
          path: resolved.guestPath,
        });
    });
    done.catch(() => undefined);
    return { path: resolved.guestPath, size, stream: h.stdout, done };
  }

  async checkpoint(name: string, opts: CheckpointOptions): Promise<Checkpoint> {
    const record = this.must(name);
    return this.locks.run(`sb:${name}`, async () => {
      const running = await this.isAlive(record.state);
      const memory = opts.live === true && running && this.criu !== null;
      const t0 = performance.now();
      let thawedAt: number | undefined;
      // Frozen while archived, so the layer is one instant of the guest, not a smear across the copy.
      if (running) await this.freeze(name);
      try {
        const cp = await this.checkpoints.write(layerDirs(this.sandboxDir(name), record.state.storage_gb).upper, {
          ...(opts.id ? { id: opts.id } : {}),
          ...(opts.maxBytes ? { maxBytes: opts.maxBytes } : {}),
          comment: opts.comment ?? '',
          image: record.state.image,
          now: new Date(),
          // Still frozen: CRIU takes the same instant (--freeze-cgroup leaves it frozen), then the guest runs on.
          ...(memory
            ? {
                memory: async () => {
                  try {
                    return await this.dumpMemory(record, true);
                  } finally {
                    await this.cgroups.setFrozen(name, false);
                    thawedAt = performance.now();
                  }
                },
              }
            : {}),
        });
        if (opts.live && !memory)
          this.log?.info({ sandbox: name, checkpoint: cp.id }, 'live checkpoint requested without criu: took a disk checkpoint');
        return { ...cp, pause_ms: running ? Math.round((thawedAt ?? performance.now()) - t0) : 0 };
      } finally {
        if (running && thawedAt === undefined) await this.cgroups.setFrozen(name, false);
      }
    });
  }

  private async freeze(name: string): Promise<void> {
    try {
      await this.cgroups.setFrozen(name, true);
    } catch (err) {
      // Never leave the guest half-frozen (FREEZING) because the freeze did not settle.
      await this.cgroups.setFrozen(name, false).catch(() => undefined);
      throw sandboxFailed(`could not freeze sandbox "${name}" for a consistent checkpoint: ${(err as Error).message}`, { name }, err);
    }
  }

  private requireCriu(): CriuFeatures {
    if (!this.criu) {
      throw new AppError(
        'MEMORY_CHECKPOINT_UNSUPPORTED',
        409,
        'this host cannot checkpoint memory (no working criu: set CRIU_PATH or install criu >= 4.0)',
      );
    }
    return this.criu;
  }

  /** CRIU dump of the sandbox's tree into a scratch directory (leaveRunning: its cgroup is frozen and stays so). */
  private async dumpMemory(record: SandboxRecord, leaveRunning: boolean): Promise<{ dir: string; meta: CriuMeta }> {
    const s = record.state;
    const entry = `.criu-${s.name}-${randomBytes(4).toString('hex')}`;
    const dir = join(this.checkpoints.staging, entry);
    // Until the checkpoint writer has moved the files out (it removes the directory).
    this.scratch.add(entry);
    setTimeout(() => this.scratch.delete(entry), 30 * 60_000).unref();
    try {
      const res = await dumpTree(this.requireCriu(), {
        initPid: s.init_pid,
        dir,
        leaveRunning,
        freezerDir: this.cgroups.freezerDir(s.name),
        uidBase: s.uid_base,
        ip: s.ip,
        hostname: s.name,
      });
      this.log?.info({ sandbox: s.name, frozen_ms: res.frozenMs, pages: res.pagesWritten, leave_running: leaveRunning }, 'criu dump');
      return { dir, meta: res.meta };
    } catch (err) {
      await rm(dir, { recursive: true, force: true });
      throw err;
    }
  }

  /**
   * Takes a memory checkpoint and stops the sandbox: its processes are gone,
   * its CPU and memory free, its disk and layer kept (state `paused`) until
   * resume() or destroy(). The checkpoint is an ordinary live one: it can be
   * moved, and restored under another name elsewhere (create with resume).
   */
  async pause(name: string, opts: { id?: string; comment?: string } = {}): Promise<Checkpoint> {
    this.requireCriu();
    const record = this.records.get(name);
    if (!record) throw sandboxNotFound(name);
    return this.locks.run(`sb:${name}`, async () => {
      const s = record.state;
      if (s.status === 'paused') return { ...(await this.checkpoints.get(s.paused_checkpoint)), pause_ms: 0 };
      if (s.status !== 'running' || !(await this.isAlive(s))) throw sandboxNotRunning(name);
      const t0 = performance.now();
      await this.freeze(name);
      const progress = { dumped: false };
      let cp: Checkpoint;
      try {
        cp = await this.checkpoints.write(layerDirs(this.sandboxDir(name), s.storage_gb).upper, {
          ...(opts.id ? { id: opts.id } : {}),
          comment: opts.comment ?? 'pause',
          image: s.image,
          now: new Date(),
          memory: async () => {
            const d = await this.dumpMemory(record, false);
            progress.dumped = true;
            return d;
          },
        });
      } catch (err) {
        // A failed dump leaves the tree running (CRIU resumes it); thaw it, nothing else changed.
        if (!progress.dumped) await this.cgroups.setFrozen(name, false).catch(() => undefined);
        else this.log?.error({ err, sandbox: name }, 'the sandbox was dumped but its checkpoint could not be kept');
        throw err;
      }
      const pauseMs = Math.round(performance.now() - t0);
      await this.unpublish(record);
      await detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip });
      // Killed by criu: the (empty) group is thawed for whoever joins it next.
      await this.cgroups.setFrozen(name, false).catch(() => undefined);
      s.status = 'paused';
      s.paused_checkpoint = cp.id;
      s.init_pid = 0;
      s.init_start = '';
      await this.persist(s);
      this.log?.info({ sandbox: name, checkpoint: cp.id, pause_ms: pauseMs }, 'sandbox paused');
      return { ...cp, pause_ms: pauseMs };
    });
  }

  /** Restores a paused sandbox from its pause checkpoint (idempotent: a running one is answered as it is). */
  async resume(name: string): Promise<SandboxInfo> {
    const record = this.records.get(name);
    if (!record) throw sandboxNotFound(name);
    return this.locks.run(`sb:${name}`, async () => {
      const s = record.state;
      if (s.status === 'running') return this.info(record);
      if (s.status !== 'paused') throw sandboxNotRunning(name);
      const cp = await this.checkpoints.get(s.paused_checkpoint);
      await this.restoreInto(record, cp);
      const old = s.paused_checkpoint;
      s.status = 'running';
      s.paused_checkpoint = '';
      await this.persist(s);
      await this.publish(record);
      await this.persist(s);
      await this.checkpoints
        .delete(old)
        .catch((err: unknown) => this.log?.warn({ err, checkpoint: old }, 'could not remove the pause checkpoint'));
      return this.info(record);
    });
  }

  /**
   * Puts a sandbox (running or paused) back to a checkpoint: its processes
   * are ended, its layer replaced by the checkpoint's; a live checkpoint
   * then resumes its processes (any sandbox's, under this one's name,
   * address and ids), a disk one boots the image afresh.
   */
  async restoreCheckpoint(name: string, checkpointId: string): Promise<SandboxInfo> {
    const record = this.records.get(name);
    if (!record || record.state.status === 'creating') throw sandboxNotFound(name);
    return this.locks.run(`sb:${name}`, async () => {
      const s = record.state;
      const cp = await this.checkpoints.get(checkpointId);
      if (cp.image !== s.image) {
        throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", the sandbox on "${s.image}"`, [
          { path: 'checkpoint_id', message: 'another image' },
        ]);
      }
      if (cp.kind === 'live') this.requireCriu();
      await this.unpublish(record);
      if (await this.isAlive(s)) await this.killInit(s);
      await detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip });
      const layer = layerDirs(this.sandboxDir(name), s.storage_gb);
      for (const d of [layer.upper, layer.work]) {
        await rm(d, { recursive: true, force: true });
        await mkdir(d, { recursive: true });
      }
      await this.checkpoints.extract(cp.id, layer.upper);
      if (cp.kind === 'live') await this.restoreInto(record, cp);
      else await this.launch(record, await resolveImage(this.opts.imageDir, s.image));
      const paused = s.paused_checkpoint;
      s.status = 'running';
      s.paused_checkpoint = '';
      s.checkpoint_id = cp.id;
      await this.persist(s);
      await this.publish(record);
      await this.persist(s);
      if (paused && paused !== cp.id) await this.checkpoints.delete(paused).catch(() => undefined);
      return this.info(record);
    });
  }

  private async killInit(s: Persisted): Promise<void> {
    try {
      process.kill(s.init_pid, 'SIGKILL');
    } catch {
      /* gone */
    }
    for (let i = 0; i < 500 && (await this.isAlive(s)); i++) await sleep(5);
    if (await this.isAlive(s)) throw sandboxFailed(`init ${s.init_pid} survived SIGKILL for 2.5 s`);
  }

  /**
   * CRIU restore of a live checkpoint as this record (its name, address,
   * MAC, veth, id block and cgroups, whatever the checkpoint's were): the
   * overlay root is mounted for the restore in the agent's namespace from
   * idmapped clones made against a throwaway user namespace with the
   * record's id map, and detached once the restored namespace holds it.
   */
  private async restoreInto(record: SandboxRecord, cp: Checkpoint): Promise<void> {
    const criu = this.requireCriu();
    const s = record.state;
    if (cp.kind !== 'live' || !(CRIU_META in cp.files)) {
      throw new AppError('CHECKPOINT_NOT_LIVE', 409, `checkpoint "${cp.id}" holds no memory: it can boot a sandbox, not resume one`, {
        id: cp.id,
      });
    }
    const cpDir = this.checkpoints.path(cp.id);
    const meta = criuMetaSchema.parse(JSON.parse(await readFile(join(cpDir, CRIU_META), 'utf8')));
    const dir = this.sandboxDir(s.name);
    const root = join(dir, 'root');
    const layer = layerDirs(dir, s.storage_gb);
    await this.firewall.apply(() => this.firewallState());
    await this.readyBridge(record);
    await deleteLink(s.veth);
    await mkdir(root, { recursive: true });
    const holder = spawn(this.tools.unshare, ['--user', '--', this.tools.busybox, 'sleep', '60'], { stdio: 'ignore' });
    let consoleFd: number | undefined;
    let mounted = false;
    const scratch = `.restore-${s.name}-${randomBytes(4).toString('hex')}`;
    this.scratch.add(scratch);
    try {
      const hpid = holder.pid;
      if (hpid === undefined) throw sandboxFailed('could not start a user namespace for the restore');
      const own = await readlink('/proc/self/ns/user');
      for (let i = 0; i < 500 && (await readlink(`/proc/${hpid}/ns/user`).catch(() => own)) === own; i++) await sleep(2);
      const map = `0 ${s.uid_base} ${USERNS_SIZE}\n`;
      await writeFile(`/proc/${hpid}/uid_map`, map);
      await writeFile(`/proc/${hpid}/gid_map`, map);
      const imagePath = await resolveImage(this.opts.imageDir, s.image);
      await mustRun(this.tools.helper, ['mount-root', String(hpid), String(s.uid_base), imagePath, dirname(layer.upper), root]);
      mounted = true;
      consoleFd = await openConsoleWriter(join(dir, 'console.log'), this.opts.consoleLogMaxBytes, this.tools.busybox, s.uid_base);
      // CRIU reopens it from inside the sandbox's user namespace, as the sandbox's root.
      fchownSync(consoleFd, s.uid_base, s.uid_base);
      const pid = await restoreTree(
        criu,
        cpDir,
        meta,
        {
          root,
          cgroupProcs: this.cgroups.procsFiles(s.name),
          uidBase: s.uid_base,
          veth: s.veth,
          bridge: s.bridge,
          mac: s.mac,
          ip: s.ip,
          prefixLen: this.subnet.prefixLen,
          gateway: this.subnet.gateway,
          hostname: s.name,
          consoleFd,
          hook: this.criuHook,
        },
        join(this.checkpoints.staging, scratch),
      );
      const start = await processStartTime(pid);
      if (start === null) throw sandboxFailed('the restored init exited right away; see the console log');
      s.init_pid = pid;
      s.init_start = start;
      await hardenLink(s.veth, 'veth');
    } finally {
      if (consoleFd !== undefined) closeSync(consoleFd);
      if (mounted) await runTool('umount', ['-l', root]);
      holder.kill('SIGKILL');
      this.scratch.delete(scratch);
    }
  }

  private async readyBridge(record: SandboxRecord): Promise<void> {
    const state = record.state;
    await this.locks.run(`br:${state.bridge}`, async () => {
      if (
        this.bridgesReady.has(state.bridge) &&
        (await bridgeForwarding(state.bridge).catch(() => null)) === this.forwardingOf(state.bridge)
      )
        return;
      const fresh =
        !this.bridgesReady.has(state.bridge) &&
        ![...this.records.values()].some((r) => r !== record && r.state.bridge === state.bridge && r.state.init_pid > 0);
      await ensureBridge(state.bridge, this.subnet, { fresh });
      this.bridgesReady.add(state.bridge);
    });
  }

  /** A cold start of the record's sandbox from its image over its layer. */
  private async launch(record: SandboxRecord, imagePath: string): Promise<void> {
    const state = record.state;
    const dir = this.sandboxDir(state.name);
    const layer = layerDirs(dir, state.storage_gb);
    const launched = await launchInit({
      imageDir: imagePath,
      upper: layer.upper,
      work: layer.work,
      rootMount: join(dir, 'root'),
      hostname: state.name,
      uidBase: state.uid_base,
      cgroupProcs: this.cgroups.procsFiles(state.name),
      consoleLog: join(dir, 'console.log'),
      consoleLogMaxBytes: this.opts.consoleLogMaxBytes,
      address: `${state.ip}/${this.subnet.prefixLen}`,
      gateway: this.subnet.gateway,
      tools: this.tools,
      netRaw: state.net_raw,
      attachNetwork: (nsPid) =>
        attachSandbox({ bridge: state.bridge, veth: state.veth, nsPid, ip: state.ip, mac: state.mac, subnet: this.subnet }),
    });
    state.init_pid = launched.initPid;
    state.init_start = launched.initStart;
  }

  /** What the writable layer holds now, and what archiving it is expected to take (checked against quotas before archiving). */
  async layerUsage(name: string): Promise<LayerUsage & { expected_archive_bytes: number }> {
    const record = this.must(name);
    const usage = await layerUsage(this.sandboxDir(name), record.state.storage_gb);
    return { ...usage, expected_archive_bytes: expectedArchiveBytes(usage) };
  }

  listCheckpoints(): Promise<Checkpoint[]> {
    return this.checkpoints.list();
  }

  getCheckpoint(id: string): Promise<Checkpoint> {
    return this.checkpoints.get(id);
  }

  deleteCheckpoint(id: string): Promise<void> {
    return this.checkpoints.delete(id);
  }

  async checkpointDir(id: string): Promise<string> {
    await this.checkpoints.get(id);
    return this.checkpoints.path(id);
  }

  stagingDir(): string {
    return this.checkpoints.staging;
  }

  importCheckpoint(stagingPath: string, opts: { verifyDigest?: boolean } = {}): Promise<Checkpoint> {
    return this.checkpoints.import(stagingPath, opts);
  }

  async recover(): Promise<SandboxInfo[]> {
    const names = await readdir(this.sandboxesDir).catch(() => [] as string[]);
    for (const name of names) {
      if (!nameRe.test(name) || this.records.has(name)) continue;
      await this.locks.run(`sb:${name}`, async () => {
        const state = await this.readState(name);
        if (!state) return; // not ours to judge here: prune() removes it
        const record: SandboxRecord = { state, proxies: [] };
        if (state.status === 'creating') {
          // The agent died mid-create: nothing was handed out, so undo it.
          await this.teardown(record, {}).catch((err: unknown) =>
            this.log?.warn({ err, sandbox: name }, 'could not undo a half-created sandbox'),
          );
          return;
        }
        this.records.set(name, record);
        // After a host reboot the disk is no longer mounted; the layer must stay reachable (checkpoint, destroy).
        if (state.storage_gb > 0)
          await mountDisk(this.sandboxDir(name)).catch((err: unknown) =>
            this.log?.warn({ err, sandbox: name }, 'could not mount the sandbox disk'),
          );
        if (await this.isAlive(state)) {
          // No freeze outlives the agent that took it: one killed mid-checkpoint left its guest frozen.
          await this.cgroups.setFrozen(name, false).catch((err: unknown) => this.log?.warn({ err, sandbox: name }, 'could not thaw'));
          await this.publish(record).catch((err: unknown) => this.log?.warn({ err, sandbox: name }, 'could not republish endpoints'));
          await this.persist(state);
        }
      });
    }
    const infos = await this.list();
    this.log?.info({ sandboxes: infos.length }, 'sandboxes recovered');
    const network = await this.reassertNetwork();
    if (network.repaired > 0) this.log?.warn({ repairs: network.repairs }, 'sandbox network rules repaired');
    if ([...this.records.values()].some((r) => usesAgentProxy(r.state.egress)))
      await this.egress.ensureProxy().catch((err: unknown) => this.log?.warn({ err }, 'the egress proxy did not start'));
    return infos;
  }

  async prune(): Promise<PruneReport> {
    const report: PruneReport = {
      bridges: [],
      veths: [],
      mounts: [],
      loopDevices: [],
      directories: [],
      cgroups: [],
      processes: [],
      tables: [],
      errors: [],
    };
    const known = new Map([...this.records.values()].map((r) => [r.state.name, r.state]));
    const note = (what: string, err: unknown): void => {
      report.errors.push(`${what}: ${(err as { message?: string }).message ?? String(err)}`);
    };
    // Mounts under the data dir: by design every sandbox mount lives in the sandbox's own namespace.
    // The exception: a known sandbox's disk, which lives in the agent's namespace on purpose (storage.ts).
    const liveDisks = new Set([...known.values()].filter((s) => s.storage_gb > 0).map((s) => join(this.sandboxDir(s.name), DISK_MOUNT)));
    const mounts = [...(await mountPoints())]
      .filter((m) => (m === this.opts.dataDir || m.startsWith(`${this.opts.dataDir}/`)) && !liveDisks.has(m))
      .sort((a, b) => b.length - a.length);
    for (const m of mounts) {
      const res = await runTool('umount', ['-l', m]);
      if (res.code === 0) report.mounts.push(m);
      else note(`umount ${m}`, new Error(res.stderr.trim()));
    }
    for (const name of await this.cgroups.list()) {
      if (known.has(name)) continue;
      try {
        report.processes.push(...(await this.cgroups.remove(name)));
        report.cgroups.push(name);
      } catch (err) {
        note(`cgroup ${name}`, err);
      }
    }
    if (this.records.size === 0 && (await this.cgroups.removeParentIfEmpty())) report.cgroups.push(this.cgroups.parent);
    const loops = await pruneLoopDevices(this.sandboxesDir, new Set([...liveDisks].map((m) => join(m, '..', DISK_IMAGE))));
    report.loopDevices.push(...loops.detached);
    report.errors.push(...loops.errors);
    const dirs = await readdir(this.sandboxesDir).catch(() => [] as string[]);
    for (const name of dirs) {
      if (known.has(name)) continue;
      await this.locks.run(`sb:${name}`, async () => {
        if (this.records.has(name)) return;
        try {
          const state = await this.readState(name);
          if (state) await this.teardown({ state, proxies: [] }, {});
          else await rm(this.sandboxDir(name), { recursive: true, force: true });
          report.directories.push(this.sandboxDir(name));
        } catch (err) {
          note(`directory ${name}`, err);
        }
      });
    }
    if (this.records.size === 0) {
      // Superseded runtime directories (the host's busybox changed) are mounted by no sandbox once none runs.
      for (const entry of await readdir(this.opts.dataDir).catch(() => [] as string[])) {
        if (entry.startsWith('runtime.old-') || entry.startsWith('runtime.tmp-')) {
          await rm(join(this.opts.dataDir, entry), { recursive: true, force: true });
          report.directories.push(join(this.opts.dataDir, entry));
        }
      }
    }
    for (const entry of await readdir(this.checkpoints.dir).catch(() => [] as string[])) {
      if (entry.startsWith('.tmp-') || entry.startsWith('.del-')) {
        await rm(join(this.checkpoints.dir, entry), { recursive: true, force: true });
        report.directories.push(join(this.checkpoints.dir, entry));
      }
    }
    // CRIU dumps and restore scratch directories of an agent that died mid-way.
    for (const entry of await readdir(this.checkpoints.staging).catch(() => [] as string[])) {
      if ((entry.startsWith('.criu-') || entry.startsWith('.restore-')) && !this.scratch.has(entry)) {
        await rm(join(this.checkpoints.staging, entry), { recursive: true, force: true });
        report.directories.push(join(this.checkpoints.staging, entry));
      }
    }
    const prefix = this.opts.bridgePrefix;
    const liveVeths = new Set([...this.records.values()].map((r) => r.state.veth));
    for (const veth of await listLinks('veth')) {
      if (veth.startsWith(`${prefix}v`) && !liveVeths.has(veth)) {
        if (await deleteLink(veth)) report.veths.push(veth);
        else note(`veth ${veth}`, new Error('ip link del failed'));
      }
    }
    const liveBridges = new Set([...this.records.values()].map((r) => r.state.bridge));
    const liveIps = new Set([...this.records.values()].map((r) => r.state.ip));
    for (const bridge of await listLinks('bridge')) {
      if (!bridge.startsWith(`${prefix}b`)) continue;
      await this.locks.run(`br:${bridge}`, async () => {
        if (!liveBridges.has(bridge) && ![...this.records.values()].some((r) => r.state.bridge === bridge)) {
          this.bridgesReady.delete(bridge);
          if (await deleteLink(bridge)) report.bridges.push(bridge);
          else note(`bridge ${bridge}`, new Error('ip link del failed'));
          return;
        }
        for (const ip of await listRoutes(bridge)) {
          if (!liveIps.has(ip)) await runTool('ip', ['route', 'del', `${ip}/32`, 'dev', bridge]);
        }
      });
    }
    // No sandbox left: the tables go too (reassert does the same).
    if (this.records.size === 0) {
      await this.firewall
        .reassert(() => this.firewallState())
        .then(
          (removed) => removed.length > 0 && report.tables.push(...this.firewall.tables),
          (err: unknown) => note('nftables', err),
        );
    }
    this.log?.info({ report }, 'prune finished');
    return report;
  }

  /**
   * Puts the network boundary back where anything changed it: our nftables
   * tables (missing or edited), and each bridge's and veth's sysctls (a
   * write of net.ipv4.ip_forward turns every bridge's forwarding back on).
   */
  async reassertNetwork(): Promise<NetworkReassertReport> {
    const repairs = await this.firewall.reassert(() => this.firewallState());
    const states = [...this.records.values()].map((r) => r.state);
    for (const bridge of new Set(states.map((s) => s.bridge)))
      repairs.push(...(await hardenLink(bridge, 'bridge', this.forwardingOf(bridge))));
    for (const s of states) repairs.push(...(await hardenLink(s.veth, 'veth')));
    return { repaired: repairs.length, repairs };
  }

  /** The bridge and host-side veth a sandbox is on (diagnostics and tests). */
  networkOf(name: string): { bridge: string; veth: string } {
    const { bridge, veth } = this.must(name).state;
    return { bridge, veth };
  }

  async close(): Promise<void> {
    this.closed = true;
    this.observer.stop();
    this.spawner?.close();
    for (const r of this.records.values()) await this.unpublish(r);
    await this.egress.close();
  }

  // ---- internals ----

  private firewallState(): FirewallState {
    const states = [...this.records.values()].map((r) => r.state);
    return {
      bridges: [...new Set(states.map((s) => s.bridge))],
      ports: states.map((s) => ({ veth: s.veth, mac: s.mac, ip: s.ip })),
      egress: { cfg: this.egress.cfg, ports: states.map((s) => ({ ip: s.ip, veth: s.veth, bridge: s.bridge, egress: s.egress })) },
    };
  }

  /** A bridge forwards (IPv4, per interface) only while a sandbox on it may leave it; the nftables rules stay the boundary. */
  private forwardingOf(bridge: string): '0' | '1' {
    return [...this.records.values()].some((r) => r.state.bridge === bridge && forwards(r.state.egress)) ? '1' : '0';
  }

  private async syncBridgeForwarding(bridge: string): Promise<void> {
    await hardenLink(bridge, 'bridge', this.forwardingOf(bridge));
  }

  private proxyPolicyOf(ip: string): SandboxEgress | undefined {
    for (const r of this.records.values()) if (r.state.ip === ip && usesAgentProxy(r.state.egress)) return r.state.egress;
    return undefined;
  }

  /** Replaces a running sandbox's outbound policy: firewall, bridge forwarding, the guest's proxy variables (later execs). */
  async setEgress(name: string, egress: SandboxEgress): Promise<SandboxInfo> {
    const parsed = sandboxEgressSchema.parse(egress);
    return this.locks.run(`sb:${name}`, async () => {
      const record = this.must(name);
      const s = record.state;
      const old = this.egress.guestEnv(s.egress, s.ip);
      s.env = { ...Object.fromEntries(Object.entries(s.env).filter(([k]) => !(k in old))), ...this.egress.guestEnv(parsed, s.ip) };
      s.egress = parsed;
      await this.persist(s);
      await this.firewall.apply(() => this.firewallState());
      await this.syncBridgeForwarding(s.bridge);
      if (usesAgentProxy(parsed)) await this.egress.ensureProxy();
      return this.info(record);
    });
  }

  /** The resolved policy with a probe of its proxy endpoint. */
  async egressStatus(name: string): Promise<NonNullable<SandboxInfo['egress']>> {
    const s = this.must(name).state;
    return this.egress.status(s.egress, s.ip, await this.egress.health(s.egress));
  }

  /**
   * A block no live sandbox of this agent uses. Random rather than the
   * lowest free one, so two agents on one host (distinct data directories)
   * are unlikely to hand out the same block; sharing one would still leave
   * the sandboxes apart (no shared files, pids or IPC), only less so.
   */
  private pickUidBase(): number {
    const used = new Set([...this.records.values()].map((r) => r.state.uid_base));
    const first = this.opts.uidBase / USERNS_SIZE;
    const blocks = 2 ** 32 / USERNS_SIZE - 1 - first;
    for (;;) {
      const base = (first + (randomBytes(4).readUInt32BE() % blocks)) * USERNS_SIZE;
      if (!used.has(base)) return base;
    }
  }

  private assertOpen(): void {
    if (this.closed) throw new AppError('BACKEND_CLOSED', 503, 'the backend is shutting down');
  }

  private must(name: string): SandboxRecord {
    const r = this.records.get(name);
    if (!r || r.state.status !== 'running') throw sandboxNotFound(name);
    return r;
  }

  private async isAlive(state: Persisted): Promise<boolean> {
    if (!state.init_pid) return false;
    return (await processStartTime(state.init_pid)) === state.init_start;
  }

  private async assertRunning(record: SandboxRecord): Promise<void> {
    if (!(await this.isAlive(record.state))) throw sandboxNotRunning(record.state.name);
  }

  private async info(record: SandboxRecord): Promise<SandboxInfo> {
    const s = record.state;
    const alive = await this.isAlive(s);
    return {
      name: s.name,
      state: s.status === 'paused' ? 'paused' : alive ? 'running' : 'stopped',
      tenant: s.tenant,
      image: s.image,
      checkpoint_id: s.checkpoint_id,
      ip: s.ip,
      mac: s.mac,
      cpus: s.cpus,
      ram_mb: s.ram_mb,
      pids_max: s.pids_max,
      created_at: s.created_at,
      init_pid: alive ? s.init_pid : 0,
      endpoints: alive ? this.endpoints(record) : [],
      console_log: join(this.sandboxDir(s.name), 'console.log'),
      egress: this.egress.status(s.egress, s.ip),
    };
  }

  private endpoints(record: SandboxRecord): Endpoint[] {
    const host = this.opts.advertiseHost ?? (this.opts.publishHost === '0.0.0.0' ? '127.0.0.1' : this.opts.publishHost);
    return record.state.expose.flatMap((e, i) => {
      const proxy = record.proxies[i];
      if (!proxy) return [];
      const protocol = e.protocol ?? 'tcp';
      const scheme = protocol === 'udp' ? 'udp' : /http/i.test(e.as) ? 'http' : 'tcp';
      return [{ as: e.as, url: `${scheme}://${host}:${proxy.hostPort}`, port: e.port, protocol, host_port: proxy.hostPort }];
    });
  }

  private async publish(record: SandboxRecord): Promise<void> {
    const s = record.state;
    const ports: number[] = [];
    for (const [i, e] of s.expose.entries()) {
      const protocol = e.protocol ?? 'tcp';
      const want = s.host_ports[i] ?? 0;
      const base = { protocol, listenHost: this.opts.publishHost, targetHost: s.ip, targetPort: e.port } as const;
      let proxy: Proxy;
      try {
        proxy = await startProxy({ ...base, listenPort: want });
      } catch (err) {
        if (want === 0)
          throw new AppError('EXPOSE_PORT_UNAVAILABLE', 500, `could not publish ${protocol} port ${e.port}: ${(err as Error).message}`);
        // The old host port was taken while the agent was down: publish anew rather than not at all.
        this.log?.warn({ sandbox: s.name, port: want }, 'previous host port taken; publishing on a new one');
        proxy = await startProxy({ ...base, listenPort: 0 });
      }
      record.proxies.push(proxy);
      ports.push(proxy.hostPort);
    }
    s.host_ports = ports;
  }

  private async unpublish(record: SandboxRecord): Promise<void> {
    const proxies = record.proxies.splice(0);
    await Promise.all(proxies.map((p) => p.close().catch(() => undefined)));
  }

  private async teardown(record: SandboxRecord, opts: DestroyOptions): Promise<void> {
    const s = record.state;
    const graceMs = opts.graceMs ?? 5000;
    const alive = await this.isAlive(s);
    if (alive && opts.drainCommand) {
      try {
        const h = await this.spawn(s.name, { argv: ['/bin/sh', '-c', opts.drainCommand], stdin: false }).catch(() => null);
        if (h) {
          h.stdout.resume();
          h.stderr.resume();
          const timer = setTimeout(() => h.kill('SIGKILL'), graceMs);
          await h.wait().finally(() => clearTimeout(timer));
        }
      } catch (err) {
        this.log?.warn({ err, sandbox: s.name }, 'drain command failed');
      }
    }
    // Every step runs even if an earlier one failed, and the record is always dropped: what a failed
    // step leaves behind is prune()'s, and state.json (removed last) lets a second destroy retry.
    const failures: string[] = [];
    const step = async (what: string, fn: () => Promise<unknown>): Promise<void> => {
      try {
        await fn();
      } catch (err) {
        failures.push(`${what}: ${(err as Error).message}`);
      }
    };
    await step('endpoints', () => this.unpublish(record));
    if (alive) {
      await step('init', async () => {
        // Killing a pid namespace's init kills every process in it; its mounts go with it.
        try {
          process.kill(s.init_pid, 'SIGKILL');
        } catch {
          /* gone */
        }
        for (let i = 0; i < 500 && (await this.isAlive(s)); i++) await sleep(5);
        if (await this.isAlive(s)) throw new Error(`init ${s.init_pid} survived SIGKILL for 2.5 s`);
      });
    }
    await step('cgroup', () => this.cgroups.remove(s.name));
    await step('network', () => detachSandbox({ bridge: s.bridge, veth: s.veth, ip: s.ip }));
    if (this.records.get(s.name) === record) this.records.delete(s.name);
    await step('firewall', () => this.firewall.apply(() => this.firewallState()));
    await step('forwarding', () => this.syncBridgeForwarding(s.bridge));
    await step('bridge', () =>
      this.locks.run(`br:${s.bridge}`, async () => {
        if (![...this.records.values()].some((r) => r.state.bridge === s.bridge)) {
          this.bridgesReady.delete(s.bridge);
          await deleteLink(s.bridge);
        }
      }),
    );
    if (s.storage_gb > 0 || existsSync(join(this.sandboxDir(s.name), DISK_IMAGE)))
      await step('disk', () => removeDisk(this.sandboxDir(s.name)));
    await step('logs', () => this.observer.keepLogs(s.name, this.sandboxDir(s.name)));
    if (s.paused_checkpoint) await step('pause checkpoint', () => this.checkpoints.delete(s.paused_checkpoint));
    await step('directory', () => rm(this.sandboxDir(s.name), { recursive: true, force: true }));
    if (failures.length > 0) {
      this.log?.warn({ sandbox: s.name, failures }, 'teardown incomplete');
      throw sandboxFailed(`tearing down sandbox "${s.name}" was incomplete (${failures.join('; ')}); destroy again or prune`, {
        name: s.name,
      });
    }
  }

  private async persist(state: Persisted): Promise<void> {
    const file = join(this.sandboxDir(state.name), 'state.json');
    await writeFile(`${file}.tmp`, JSON.stringify(state, null, 2), { mode: 0o600 });
    await rename(`${file}.tmp`, file);
  }

  private async readState(name: string): Promise<Persisted | null> {
    try {
      const parsed = persistedSchema.safeParse(JSON.parse(await readFile(join(this.sandboxDir(name), 'state.json'), 'utf8')));
      return parsed.success && parsed.data.name === name ? parsed.data : null;
    } catch {
      return null;
    }
  }
}

function clampSize(n: number, fallback: number): number {
  return Number.isInteger(n) && n > 0 && n <= 1000 ? n : fallback;
}

async function assertHostFeatures(): Promise<void> {
  if (process.platform !== 'linux') throw featureMissing('Linux', 'the process backend runs sandboxes with Linux namespaces');
  if (typeof process.getuid === 'function' && process.getuid() !== 0)
    throw featureMissing('root', 'the process backend must run as root (namespaces, mounts, cgroups, bridges)');
  const fss = await readFile('/proc/filesystems', 'utf8').catch(() => '');
  if (!/\toverlay$/m.test(fss)) {
    // The module may simply not be loaded yet.
    await runTool('modprobe', ['overlay']).catch(() => undefined);
    const again = await readFile('/proc/filesystems', 'utf8').catch(() => '');
    if (!/\toverlay$/m.test(again)) throw featureMissing('overlayfs', 'load the overlay kernel module (modprobe overlay)');
  }
  for (const ns of ['user', 'pid', 'mnt', 'uts', 'ipc', 'net']) {
    if (!existsSync(`/proc/self/ns/${ns}`)) throw featureMissing(`${ns} namespaces`, 'use a kernel built with namespaces');
  }
}
