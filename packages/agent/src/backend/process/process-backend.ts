import { existsSync } from 'node:fs';
import { chmod, mkdir, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { randomBytes } from 'node:crypto';
import { join, resolve } from 'node:path';
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
import { KeyedMutex, processStartTime, runTool, sleep } from './exec-util.js';
import { resolveInRoot } from './guest-path.js';
import { Spawner, spawnPiped, spawnPty } from './guest-process.js';
import { enterArgv, findHostTools, launchInit, USERNS_SIZE, type EnterOp, type HostTools } from './launch.js';
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
});
export type ProcessBackendOptions = z.input<typeof optionsSchema> & { logger?: Logger };

const nameRe = /^[a-z0-9][a-z0-9-]{0,62}$/;
const tenantRe = /^[a-z0-9][a-z0-9_-]{0,62}$/;
const envKeyRe = /^[A-Za-z_][A-Za-z0-9_]*$/;

const exposeSchema = z.object({
  port: z.number().int().min(1).max(65535),
  as: z.string().min(1).max(63),
  protocol: z.enum(['tcp', 'udp']).optional(),
});

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
  expose: z.array(exposeSchema).max(64).optional(),
  env: z
    .record(
      z.string().regex(envKeyRe, 'an environment variable name'),
      z.string().refine((v) => !v.includes('\0'), 'no NUL bytes'),
    )
    .optional(),
  /** Keep CAP_NET_RAW (raw sockets: ping, packet capture); dropped by default. */
  net_raw: z.boolean().optional(),
});

const persistedSchema = z.object({
  version: z.literal(1),
  name: z.string(),
  status: z.enum(['creating', 'running']),
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
    await backend.recover();
    backend.spawner = await Spawner.start(tools.helper, join(opts.dataDir, 'exec.sock'), (err) =>
      logger?.warn({ err }, 'exec spawner'),
    ).catch((err: unknown) => {
      logger?.warn({ err }, 'the exec spawner did not start: every exec spawns the helper');
      return null;
    });
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
    // again: a probe while sandboxes run must not count them twice.
    const held = [...this.records.values()].reduce((n, r) => n + r.state.storage_gb, 0);
    return { ...cap, storage_gb: cap.storage_gb + held };
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
      };
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
        await this.locks.run(`br:${state.bridge}`, async () => {
          // Three ip(8) runs cost tens of ms on a busy host; skip them for a bridge this process set up and that still exists.
          if (this.bridgesReady.has(state.bridge) && (await bridgeForwarding(state.bridge).catch(() => null)) === '0') return;
          const fresh =
            !this.bridgesReady.has(state.bridge) &&
            ![...this.records.values()].some((r) => r !== record && r.state.bridge === state.bridge && r.state.init_pid > 0);
          await ensureBridge(state.bridge, this.subnet, { fresh });
          this.bridgesReady.add(state.bridge);
        });
        mark('bridge');
        const launched = await launchInit({
          imageDir: imagePath,
          upper: layer.upper,
          work: layer.work,
          rootMount: join(dir, 'root'),
          hostname: spec.name,
          uidBase: state.uid_base,
          cgroupProcs: this.cgroups.procsFiles(spec.name),
          consoleLog: join(dir, 'console.log'),
          consoleLogMaxBytes: this.opts.consoleLogMaxBytes,
          address: `${ip}/${this.subnet.prefixLen}`,
          gateway: this.subnet.gateway,
          tools: this.tools,
          netRaw: state.net_raw,
          // A concurrent teardown never deletes this bridge: this record, on it, is already in `records`.
          attachNetwork: (nsPid) => attachSandbox({ bridge: state.bridge, veth: state.veth, nsPid, ip, mac, subnet: this.subnet }),
        });
        mark('init');
        state.init_pid = launched.initPid;
        state.init_start = launched.initStart;
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
    return this.info(this.must(name));
  }

  async list(prefix = ''): Promise<SandboxInfo[]> {
    const out: SandboxInfo[] = [];
    for (const r of this.records.values()) {
      if (r.state.status === 'running' && r.state.name.startsWith(prefix)) out.push(await this.info(r));
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
      // Frozen while archived, so the layer is one instant of the guest, not a smear across the copy.
      if (running) {
        try {
          await this.cgroups.setFrozen(name, true);
        } catch (err) {
          // Never leave the guest half-frozen (FREEZING) because the freeze did not settle.
          await this.cgroups.setFrozen(name, false).catch(() => undefined);
          throw sandboxFailed(`could not freeze sandbox "${name}" for a consistent checkpoint: ${(err as Error).message}`, { name }, err);
        }
      }
      try {
        const cp = await this.checkpoints.write(layerDirs(this.sandboxDir(name), record.state.storage_gb).upper, {
          ...(opts.id ? { id: opts.id } : {}),
          ...(opts.maxBytes ? { maxBytes: opts.maxBytes } : {}),
          comment: opts.comment ?? '',
          image: record.state.image,
          now: new Date(),
        });
        if (opts.live)
          this.log?.info(
            { sandbox: name, checkpoint: cp.id },
            'live checkpoint requested: the process backend cannot capture memory, took a disk checkpoint',
          );
        return cp;
      } finally {
        if (running) await this.cgroups.setFrozen(name, false);
      }
    });
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
          await this.publish(record).catch((err: unknown) => this.log?.warn({ err, sandbox: name }, 'could not republish endpoints'));
          await this.persist(state);
        }
      });
    }
    const infos = await this.list();
    this.log?.info({ sandboxes: infos.length }, 'sandboxes recovered');
    const network = await this.reassertNetwork();
    if (network.repaired > 0) this.log?.warn({ repairs: network.repairs }, 'sandbox network rules repaired');
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
    for (const bridge of new Set(states.map((s) => s.bridge))) repairs.push(...(await hardenLink(bridge, 'bridge')));
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
    this.spawner?.close();
    for (const r of this.records.values()) await this.unpublish(r);
  }

  // ---- internals ----

  private firewallState(): FirewallState {
    const states = [...this.records.values()].map((r) => r.state);
    return { bridges: [...new Set(states.map((s) => s.bridge))], ports: states.map((s) => ({ veth: s.veth, mac: s.mac, ip: s.ip })) };
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
      state: alive ? 'running' : 'stopped',
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
