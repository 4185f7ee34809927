import { createHash, randomBytes, randomUUID } from 'node:crypto';
import { existsSync } from 'node:fs';
import { chmod, mkdir, readdir, readFile, rename, rm, stat, writeFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { PassThrough, Transform, type Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import type { Logger } from 'pino';
import { z } from 'zod';
import { AppError, type AgentEgressParsed, type EgressStatus, type HostCapacity } from '@fleet/agent-protocol';
import {
  capacityExhausted,
  guestPathNotFound,
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
  type LayerUsageReport,
  type MigrationSendReport,
  type MigrationTarget,
  type NetworkReassertReport,
  type ProcessHandle,
  type PruneReport,
  type SandboxInfo,
  type SpawnOptions,
} from '../../backend.js';
import { probeCapacity, withoutDevices } from '../host-capacity.js';
import { KeyedMutex, mustRun, processStartTime, runTool, sleep } from '../process/exec-util.js';
import { Firewall, type FirewallState } from '../process/firewall.js';
import { allocateBridge, ensureBridge, hardenLink, parseSubnet, reserve, type Subnet } from '../process/network.js';
import { startProxy, type Proxy } from '../process/proxy.js';
import { chooseAccel, type Accel, type AccelReport } from './accel.js';
import { buildQemuArgs } from './command.js';
import { ConsoleLog } from './console.js';
import { guestRun, guestSpawn, type GuestTarget } from './guest-client.js';
import { GUEST_AGENT_PORT, resolveQemuImage, type QemuImage } from './image.js';
import { qmp } from './qmp.js';
import { sendIdentity } from './control.js';
import {
  capture,
  DISK_FILE,
  loadState,
  qemuMetaSchema,
  readMeta,
  verifyState,
  waitIncoming,
  switchToPostcopy,
  waitMigration,
  writeCheckpoint,
  type QemuMeta,
} from './state.js';
import { CheckpointStore, expectedArchiveBytes } from '../process/checkpoints.js';
import { envKeyRe, exposeSchema, nameRe, tenantRe } from '../spec-rules.js';

/**
 * `AGENT_BACKEND=qemu`: every sandbox is a QEMU VM (q35, virtio disk and
 * net, the host's Debian kernel booted directly) on a tap of its tenant's
 * bridge, with a statically assigned address carried by its seed disk.
 * Guest processes and files go through the in-guest agent over TCP to the
 * guest's address, authenticated by a per-VM token the seed carries.
 *
 * State lives in `<dataDir>/qemu/vms/<name>/` (state.json, overlay.qcow2,
 * seed.tar, serial.log, qemu.pid); the QMP and serial sockets in
 * `<dataDir>/qemu/run/<hash of name>.{qmp,serial}` (a unix socket path must
 * stay under 108 bytes, a VM name can be 63). QEMU daemonizes into its own
 * session, so VMs outlive the agent; recover() finds them again by pid (with
 * its start time, against pid reuse) and a QMP query.
 * Design and limits: docs/qemu-backend.md.
 */

const DEFAULT_PATH = '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin';

export interface QemuBackendOptions {
  readonly dataDir: string;
  readonly imageDir: string;
  readonly subnet: string;
  readonly bridgePrefix: string;
  readonly maxSandboxes: number;
  readonly allowCrossTenant: boolean;
  readonly publishHost: string;
  readonly advertiseHost?: string;
  readonly defaultImage: string;
  /** auto: probe KVM and fall back to TCG. */
  readonly accel?: 'auto' | Accel;
  /** Bound on boot until the in-guest agent answers. */
  readonly bootTimeoutMs?: number;
  /** Bound on the KVM probe. */
  readonly kvmProbeTimeoutMs?: number;
  readonly qemuBinary?: string;
  /** serial.log is cut to its newer half past this. */
  readonly consoleLogMaxBytes?: number;
  readonly logger?: Logger;
}

const createSpecSchema = z.object({
  name: z.string().regex(nameRe, 'a sandbox name is 1-63 of [a-z0-9-], starting with a letter or digit'),
  image: z.string().min(1).optional(),
  checkpointId: z.string().min(1).optional(),
  resume: z.boolean().optional(),
  cpus: z.number().positive().max(255),
  ram_mb: z
    .number()
    .int()
    .min(128, 'a VM needs at least 128 MiB')
    .max(1024 * 1024),
  pids_max: z.number().int().optional(),
  storage_gb: z.number().int().min(0).max(65536).optional(),
  tenant: z.string().regex(tenantRe, 'a tenant id is 1-63 of [a-z0-9_-], starting with a letter or digit'),
  ipHint: z.string().optional(),
  expose: z.array(exposeSchema).max(64).optional(),
  env: z
    .record(
      z.string().regex(envKeyRe, 'an environment variable name'),
      z.string().refine((v) => !v.includes('\0')),
    )
    .optional(),
  net_raw: z.boolean().optional(),
  /** Cluster networks are built for the process backend only: refused here, never joined as the tenant's bridge. */
  network: z.undefined({ error: 'cluster networks are not supported on qemu hosts' }).optional(),
});

const stateSchema = z.object({
  name: z.string(),
  status: z.enum(['creating', 'running', 'paused']),
  /** While paused: the live checkpoint its state is in (resume loads it). */
  paused_checkpoint: z.string().default(''),
  /** The checkpoint it was last restored from. */
  checkpoint_id: z.string().default(''),
  /** vmgenid guid: a new one on every restore of a copy (a fork, an earlier state), so the guest reseeds its RNG. */
  vmgenid: z.string().default(''),
  tenant: z.string(),
  image: z.string(),
  ip: z.string(),
  mac: z.string(),
  cpus: z.number(),
  ram_mb: z.number(),
  storage_gb: z.number(),
  disk_bytes: z.number(),
  created_at: z.string(),
  bridge: z.string(),
  tap: z.string(),
  token: z.string(),
  accel: z.enum(['kvm', 'tcg']),
  env: z.record(z.string(), z.string()),
  expose: z.array(exposeSchema),
  endpoints: z.array(z.object({ as: z.string(), port: z.number(), protocol: z.enum(['tcp', 'udp']), host_port: z.number() })),
  pid: z.number(),
  pid_start: z.string(),
});
type VmState = z.infer<typeof stateSchema>;

interface VmRecord {
  state: VmState;
  proxies: Proxy[];
  console?: ConsoleLog | undefined;
  /** Waiting for a live migration's stream (prepareIncoming until completeIncoming). */
  incoming?: { pskDir: string; timer: NodeJS.Timeout } | undefined;
  /** A post-copy source still sending pages: the target's guest needs this QEMU until it settles. */
  draining?: Promise<void> | undefined;
}

const nameHash = (name: string): string => createHash('sha256').update(name).digest('hex').slice(0, 12);

export const unsupportedByQemu = (what: string): AppError =>
  new AppError('BACKEND_UNSUPPORTED', 409, `the qemu backend does not support ${what} yet (docs/qemu-backend.md)`, { backend: 'qemu' });

export class QemuBackend implements Backend {
  readonly kind = 'qemu' as const;
  private readonly records = new Map<string, VmRecord>();
  private readonly creating = new Set<string>();
  private readonly locks = new KeyedMutex();
  private readonly vmsDir: string;
  private readonly runDir: string;
  private closed = false;
  /** Post-copy needs userfaultfd in the target's kernel (QEMU runs as root: the unprivileged switch does not matter). */
  private readonly lazyPages = existsSync('/proc/sys/vm/unprivileged_userfaultfd');

  private constructor(
    private readonly opts: QemuBackendOptions & { bootTimeoutMs: number; qemuBinary: string },
    private readonly subnet: Subnet,
    private readonly firewall: Firewall,
    readonly accel: AccelReport,
    private readonly log: Logger | undefined,
    private readonly store: CheckpointStore,
    private readonly qemuVersion: string,
  ) {
    this.vmsDir = join(opts.dataDir, 'qemu', 'vms');
    this.runDir = join(opts.dataDir, 'qemu', 'run');
  }

  static async open(options: QemuBackendOptions): Promise<QemuBackend> {
    const opts = {
      ...options,
      dataDir: resolve(options.dataDir),
      imageDir: resolve(options.imageDir),
      bootTimeoutMs: options.bootTimeoutMs ?? 180_000,
      qemuBinary: options.qemuBinary ?? 'qemu-system-x86_64',
    };
    if (!/^[a-z][a-z0-9]{0,4}$/.test(opts.bridgePrefix)) throw invalidSpec('bridgePrefix must be 1-5 of [a-z0-9], starting with a letter');
    const subnet = parseSubnet(opts.subnet);
    for (const tool of [opts.qemuBinary, 'qemu-img', 'ip', 'tar']) {
      const found = await runTool('sh', ['-c', `command -v "${tool}"`]).catch(() => null);
      if (!found || found.code !== 0) {
        throw new AppError(
          'HOST_FEATURE_MISSING',
          500,
          `host feature missing: ${tool}; apt-get install qemu-system-x86 qemu-utils iproute2 tar`,
          {
            feature: tool,
          },
        );
      }
    }
    const accel = await chooseAccel(opts.accel ?? 'auto', { qemu: opts.qemuBinary, timeoutMs: options.kvmProbeTimeoutMs ?? 3_000 });
    options.logger?.info({ accel: accel.accel, nested_virt: accel.nestedVirtSupported, reason: accel.reason }, 'qemu accelerator');
    if (join(opts.dataDir, 'qemu', 'run', `${'x'.repeat(12)}.serial`).length > 107) {
      throw invalidSpec(`AGENT_DATA_DIR "${opts.dataDir}" is too long for the VMs' unix sockets: use a path under about 70 characters`);
    }
    await mkdir(join(opts.dataDir, 'qemu', 'vms'), { recursive: true, mode: 0o700 });
    await mkdir(join(opts.dataDir, 'qemu', 'run'), { recursive: true, mode: 0o700 });
    await chmod(join(opts.dataDir, 'qemu'), 0o700);
    await mkdir(join(opts.dataDir, 'staging'), { recursive: true, mode: 0o700 });
    // Its own tables: a process backend on the same prefix must not have its ruleset replaced by ours.
    const firewall = await Firewall.open(`${opts.bridgePrefix}v`);
    const store = new CheckpointStore(join(opts.dataDir, 'checkpoints'), join(opts.dataDir, 'staging'));
    await store.init();
    const version = (await runTool(opts.qemuBinary, ['--version'])).stdout.split('\n')[0]?.trim() ?? '';
    const backend = new QemuBackend(opts, subnet, firewall, accel, options.logger, store, version);
    await backend.recover();
    return backend;
  }

  // ---- naming ----

  private vmDir(name: string): string {
    return join(this.vmsDir, name);
  }
  private qmpPath(name: string): string {
    return join(this.runDir, `${nameHash(name)}.qmp`);
  }
  private serialPath(name: string): string {
    return join(this.runDir, `${nameHash(name)}.serial`);
  }
  private controlPath(name: string): string {
    return join(this.runDir, `${nameHash(name)}.ctl`);
  }
  private async startConsole(r: VmRecord): Promise<void> {
    await r.console?.close();
    r.console = await ConsoleLog.start({
      socketPath: this.serialPath(r.state.name),
      logPath: join(this.vmDir(r.state.name), 'serial.log'),
      maxBytes: this.opts.consoleLogMaxBytes ?? 16 * 1024 * 1024,
      running: () => this.alive(r.state),
    });
  }
  private processName(name: string): string {
    return `fleet:${this.opts.bridgePrefix}:${name}`;
  }
  private bridgeStem(): string {
    return `${this.opts.bridgePrefix}v`;
  }
  private tapRe(): RegExp {
    return new RegExp(`^${this.opts.bridgePrefix}vt\\d+$`);
  }
  private bridgeRe(): RegExp {
    return new RegExp(`^${this.opts.bridgePrefix}vb(\\d+|shared)$`);
  }

  // ---- capacity ----

  async capacity(): Promise<HostCapacity & { accel: Accel; nested_virt_supported: boolean }> {
    // GPUs are left out until create can bind them (the command line is ready: command.ts).
    const { capacity } = withoutDevices(await probeCapacity({ dataDir: this.opts.dataDir, maxSandboxes: this.opts.maxSandboxes }));
    return {
      ...capacity,
      accel: this.accel.accel,
      nested_virt_supported: this.accel.nestedVirtSupported,
      // QEMU writes and loads its own state: no host tool needed. No dirty-page diffs, no postcopy (yet).
      live_snapshot: true,
      lazy_pages: this.lazyPages,
      memory_diff: false,
    };
  }

  /** backend.go.txt NestedVirtSupported. */
  nestedVirtSupported(): boolean {
    return this.accel.nestedVirtSupported;
  }

  /** backend.go.txt SupportsClustering: VMs of one tenant share a bridge and reach each other. */
  supportsClustering(): boolean {
    return true;
  }

  // ---- create ----

  setEgress(_name: string, _egress: AgentEgressParsed): Promise<SandboxInfo> {
    return Promise.reject(unsupportedByQemu('changing the outbound policy'));
  }

  /** What a qemu VM has: no outbound network. */
  async egressStatus(name: string): Promise<EgressStatus> {
    await this.get(name);
    return { mode: 'none' };
  }

  async create(input: CreateSpec): Promise<SandboxInfo> {
    if (this.closed) throw sandboxFailed('the qemu backend is closed');
    // Its taps have no NAT or egress proxy yet: a VM asking for outbound access is refused, never booted without it.
    if (input.egress && input.egress.mode !== 'none')
      throw unsupportedByQemu(`egress mode "${input.egress.mode}" (create with egress {"mode":"none"})`);
    const parsed = createSpecSchema.safeParse(input);
    if (!parsed.success) {
      throw invalidSpec(
        `invalid sandbox spec: ${parsed.error.issues.map((i) => `${i.path.join('.') || '(spec)'}: ${i.message}`).join('; ')}`,
        parsed.error.issues.map((i) => ({ path: i.path.join('.'), message: i.message })),
      );
    }
    const spec = parsed.data;
    if (spec.resume && !spec.checkpointId) {
      throw invalidSpec('resume needs a checkpointId (a live checkpoint)', [{ path: 'resume', message: 'needs checkpointId' }]);
    }
    if (spec.pids_max !== undefined) {
      throw invalidSpec('pids_max does not apply to a VM (the guest runs its own kernel)', [
        { path: 'pids_max', message: 'not supported' },
      ]);
    }
    const ports = new Set<string>();
    for (const e of spec.expose ?? []) {
      const key = `${e.protocol ?? 'tcp'}/${e.port}`;
      if (ports.has(key)) throw invalidSpec(`port ${key} is exposed twice`, [{ path: 'expose', message: 'duplicate port' }]);
      ports.add(key);
    }
    return this.locks.run(`vm:${spec.name}`, async () => {
      if (this.records.has(spec.name) || this.creating.has(spec.name)) throw sandboxExists(spec.name);
      const from = spec.checkpointId ? await this.fromCheckpoint(spec) : undefined;
      const image = await resolveQemuImage(this.opts.imageDir, from?.cp.image ?? spec.image ?? this.opts.defaultImage);
      if (from?.meta) await this.checkMachine(from.cp, from.meta, image);
      this.creating.add(spec.name);
      try {
        return await this.createLocked(spec, image, from);
      } finally {
        this.creating.delete(spec.name);
      }
    });
  }

  /** A create from a checkpoint: the checkpoint, and for a resume the machine its state needs (the spec must agree with it). */
  private async fromCheckpoint(spec: z.infer<typeof createSpecSchema>): Promise<{ cp: Checkpoint; meta?: QemuMeta }> {
    const cp = await this.store.get(spec.checkpointId ?? '');
    if (spec.image && spec.image !== cp.image) {
      throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", not "${spec.image}": omit image or name the checkpoint's`, [
        { path: 'image', message: 'conflicts with the checkpoint' },
      ]);
    }
    if (!spec.resume) return { cp };
    const meta = await readMeta(this.store, cp);
    this.checkSize(spec, meta, `checkpoint "${cp.id}"`);
    return { cp, meta };
  }

  /** A state loads only into the machine it came from: same accelerator, QEMU build and base image build. */
  private async checkMachine(cp: Checkpoint, meta: QemuMeta, image: QemuImage): Promise<void> {
    const why = await this.machineMismatch(meta, image);
    if (why) throw new AppError('CHECKPOINT_INCOMPATIBLE', 409, `checkpoint "${cp.id}" cannot be resumed here: ${why}`, { id: cp.id });
  }

  private async machineMismatch(meta: QemuMeta, image: QemuImage): Promise<string> {
    return meta.accel !== this.accel.accel
      ? `it was captured under ${meta.accel}, this host runs ${this.accel.accel}`
      : meta.qemu_version !== this.qemuVersion
        ? `it was written by "${meta.qemu_version}", this host runs "${this.qemuVersion}"`
        : meta.image_build !== (await imageBuild(image))
          ? `its disk is a delta over another build of image "${image.name}"`
          : '';
  }

  /** A state loads only into a machine of its size. */
  private checkSize(spec: z.infer<typeof createSpecSchema>, meta: QemuMeta, what: string): void {
    const fields: { path: string; message: string }[] = [];
    if (Math.max(1, Math.ceil(spec.cpus)) !== meta.cpus) fields.push({ path: 'cpus', message: `the state was captured with ${meta.cpus}` });
    if (spec.ram_mb !== meta.ram_mb) fields.push({ path: 'ram_mb', message: `the state was captured with ${meta.ram_mb}` });
    if ((spec.storage_gb ?? 0) * 1024 ** 3 > meta.disk_bytes) fields.push({ path: 'storage_gb', message: 'larger than the captured disk' });
    if (fields.length > 0) {
      throw invalidSpec(
        `${what} holds the memory of a VM of another size: a resumed VM keeps its machine (${fields.map((f) => f.path).join(', ')})`,
        fields,
      );
    }
  }

  private async createLocked(
    spec: z.infer<typeof createSpecSchema>,
    image: QemuImage,
    from?: { cp: Checkpoint; meta?: QemuMeta },
  ): Promise<SandboxInfo> {
    const dir = this.vmDir(spec.name);
    const record = await this.allocate(
      spec,
      image,
      from?.meta?.disk_bytes ?? Math.max(image.rootBytes, (spec.storage_gb ?? 0) * 1024 ** 3),
      from?.cp.id ?? '',
    );
    const state = record.state;
    const started = Date.now();
    try {
      await this.plugNetwork(state);
      await this.firewall.apply(() => this.firewallState());
      if (from) {
        await this.diskFromCheckpoint(state, from.cp, image);
        // A cold boot over a checkpoint's disk may grow it (the guest grows its filesystem at boot); a resumed state may not.
        if (!from.meta && state.disk_bytes > (await virtualSize(join(dir, DISK_FILE)))) {
          await mustRun('qemu-img', ['resize', '-q', join(dir, DISK_FILE), String(state.disk_bytes)]);
        }
        if (!from.meta) state.disk_bytes = Math.max(state.disk_bytes, await virtualSize(join(dir, DISK_FILE)));
      } else {
        await mustRun('qemu-img', [
          'create',
          '-q',
          '-f',
          'qcow2',
          '-b',
          image.rootfs,
          '-F',
          'qcow2',
          join(dir, DISK_FILE),
          String(state.disk_bytes),
        ]);
      }
      await this.writeSeed(state);
      if (from?.meta) {
        await this.loadInto(record, from.cp, image, started);
      } else {
        await this.launch(state, image);
        await this.writeState(state);
        await this.startConsole(record);
        await this.waitForGuest(state, started);
      }
      await this.publish(record);
      state.status = 'running';
      await this.writeState(state);
    } catch (err) {
      await this.teardown(record, { graceMs: 0 }).catch(() => undefined);
      throw err instanceof AppError ? err : sandboxFailed(`creating VM "${spec.name}" failed: ${(err as Error).message}`, {}, err);
    }
    this.log?.info({ vm: spec.name, ip: state.ip, accel: state.accel, boot_ms: Date.now() - started }, 'VM created');
    return this.info(record);
  }

  /** Name, address, MAC, tap and bridge, taken under one lock and recorded (status `creating`) before anything is made. */
  private async allocate(
    spec: z.infer<typeof createSpecSchema>,
    image: QemuImage,
    diskBytes: number,
    checkpointId: string,
  ): Promise<VmRecord> {
    const dir = this.vmDir(spec.name);
    // Addresses, taps and bridges are host-wide: allocate under one lock and record before anything is made.
    return this.locks.run('alloc', async () => {
      // Every VM past this point (being created or running) is in records.
      if (this.records.size >= this.opts.maxSandboxes) {
        throw capacityExhausted(`${this.opts.maxSandboxes} VMs already run here`, { max: this.opts.maxSandboxes });
      }
      const others = [...this.records.values()].map((r) => r.state);
      const { ip, mac } = reserve(this.subnet, spec.name, spec.ipHint, new Set(others.map((s) => s.ip)));
      const bridge = allocateBridge(this.bridgeStem(), spec.tenant, this.opts.allowCrossTenant, others);
      let tap = '';
      for (let i = 0; ; i++) {
        tap = `${this.opts.bridgePrefix}vt${i}`;
        if (!others.some((s) => s.tap === tap)) break;
      }
      const st: VmState = {
        name: spec.name,
        status: 'creating',
        paused_checkpoint: '',
        checkpoint_id: checkpointId,
        vmgenid: randomUUID(),
        tenant: spec.tenant,
        image: image.name,
        ip,
        mac,
        cpus: spec.cpus,
        ram_mb: spec.ram_mb,
        storage_gb: spec.storage_gb ?? 0,
        disk_bytes: diskBytes,
        created_at: new Date().toISOString(),
        bridge,
        tap,
        token: randomBytes(24).toString('hex'),
        accel: this.accel.accel,
        env: spec.env ?? {},
        expose: spec.expose ?? [],
        endpoints: [],
        pid: 0,
        pid_start: '',
      };
      await rm(dir, { recursive: true, force: true });
      await mkdir(dir, { recursive: true, mode: 0o700 });
      await this.writeState(st);
      // Recorded now so the next allocation sees its address, tap and bridge taken.
      const record: VmRecord = { state: st, proxies: [] };
      this.records.set(spec.name, record);
      return record;
    });
  }

  private async plugNetwork(s: VmState): Promise<void> {
    const fresh = ![...this.records.values()].some((r) => r.state.name !== s.name && r.state.bridge === s.bridge);
    await ensureBridge(s.bridge, this.subnet, { fresh });
    await runTool('ip', ['link', 'del', s.tap]);
    await mustRun('ip', ['tuntap', 'add', 'dev', s.tap, 'mode', 'tap']);
    await hardenLink(s.tap, 'veth');
    await mustRun('ip', ['-batch', '-'], {
      input:
        [`link set ${s.tap} master ${s.bridge} up`, `route replace ${s.ip}/32 dev ${s.bridge} src ${this.subnet.gateway}`].join('\n') +
        '\n',
    });
  }

  /** The seed disk: a tar the initramfs unpacks into a tmpfs (/run/fleet), so the token never lands on the VM's disk. */
  private async writeSeed(s: VmState): Promise<void> {
    const dir = this.vmDir(s.name);
    const seed = join(dir, 'seed');
    await rm(seed, { recursive: true, force: true });
    await mkdir(seed, { mode: 0o700 });
    const net = {
      FLEET_HOSTNAME: s.name,
      FLEET_IP: s.ip,
      FLEET_PREFIX: String(this.subnet.prefixLen),
      FLEET_GATEWAY: this.subnet.gateway,
      FLEET_MAC: s.mac,
    };
    await writeFile(
      join(seed, 'net.env'),
      Object.entries(net)
        .map(([k, v]) => `${k}=${v}\n`)
        .join(''),
    );
    await writeFile(join(seed, 'token'), s.token, { mode: 0o600 });
    await mustRun('tar', ['-cf', join(dir, 'seed.tar'), '--owner=0', '--group=0', '-C', seed, '.']);
    await chmod(join(dir, 'seed.tar'), 0o600);
    await rm(seed, { recursive: true, force: true });
  }

  private async launch(s: VmState, image: QemuImage, opts: { incoming?: boolean } = {}): Promise<void> {
    const dir = this.vmDir(s.name);
    // An old state file (before memory restores) has none; a VM's generation id is fixed at its launch.
    if (!s.vmgenid) s.vmgenid = randomUUID();
    const args = buildQemuArgs({
      processName: this.processName(s.name),
      accel: s.accel,
      cpus: Math.max(1, Math.ceil(s.cpus)),
      memoryMb: s.ram_mb,
      kernel: image.kernel,
      initrd: image.initrd,
      diskPath: join(dir, DISK_FILE),
      seedPath: join(dir, 'seed.tar'),
      mac: s.mac,
      tap: s.tap,
      serialSocket: this.serialPath(s.name),
      qmpSocket: this.qmpPath(s.name),
      controlSocket: this.controlPath(s.name),
      vmGenId: s.vmgenid,
      incoming: opts.incoming === true,
      pidFile: join(dir, 'qemu.pid'),
    });
    // -daemonize: the parent exits once the VM is set up (errors come back on stderr first).
    const res = await runTool(this.opts.qemuBinary, args, { timeoutMs: 60_000 });
    if (res.code !== 0) throw sandboxFailed(`qemu did not start (exit ${res.code}): ${res.stderr.trim().slice(0, 500)}`, { vm: s.name });
    const pid = Number((await readFile(join(dir, 'qemu.pid'), 'utf8')).trim());
    const startTime = await processStartTime(pid);
    if (!startTime) throw sandboxFailed(`qemu exited right after start: ${await this.serialTail(s.name)}`, { vm: s.name });
    s.pid = pid;
    s.pid_start = startTime;
  }

  /** backend.go.txt WaitForIP: the address is static; wait until the guest answers on it (the in-guest agent runs a command). */
  private async waitForGuest(s: VmState, started: number): Promise<void> {
    const target = this.target(s);
    for (;;) {
      if (!(await this.alive(s)))
        throw sandboxFailed(`VM "${s.name}" stopped while booting: ${await this.serialTail(s.name)}`, { vm: s.name });
      const r = await guestRun(target, ['true'], { timeoutMs: 10_000, connectTimeoutMs: 2_000 }).catch(() => null);
      if (r?.code === 0) return;
      if (Date.now() - started > this.opts.bootTimeoutMs) {
        throw sandboxFailed(`VM "${s.name}" did not answer within ${this.opts.bootTimeoutMs} ms: ${await this.serialTail(s.name)}`, {
          vm: s.name,
        });
      }
      await sleep(250);
    }
  }

  private async serialTail(name: string): Promise<string> {
    const text = await readFile(join(this.vmDir(name), 'serial.log'), 'utf8').catch(() => '');
    return text.slice(-600).trim() || '(serial console empty)';
  }

  private async publish(record: VmRecord): Promise<void> {
    const s = record.state;
    const endpoints: VmState['endpoints'] = [];
    for (const e of s.expose) {
      const protocol = e.protocol ?? 'tcp';
      const prior = s.endpoints.find((p) => p.port === e.port && p.protocol === protocol);
      let proxy: Proxy;
      try {
        proxy = await startProxy({
          protocol,
          listenHost: this.opts.publishHost,
          listenPort: prior?.host_port ?? 0,
          targetHost: s.ip,
          targetPort: e.port,
        });
      } catch (err) {
        throw new AppError('EXPOSE_PORT_UNAVAILABLE', 500, `could not publish ${protocol}/${e.port}: ${(err as Error).message}`, {
          port: e.port,
        });
      }
      record.proxies.push(proxy);
      endpoints.push({ as: e.as, port: e.port, protocol, host_port: proxy.hostPort });
    }
    s.endpoints = endpoints;
  }

  // ---- read ----

  async get(name: string): Promise<SandboxInfo> {
    const r = this.records.get(name);
    // A paused VM exists (its disk, its checkpoint): it can be read, resumed and destroyed, not entered.
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    return this.info(r);
  }

  async list(prefix = ''): Promise<SandboxInfo[]> {
    const out: SandboxInfo[] = [];
    for (const r of this.records.values())
      if (r.state.status !== 'creating' && r.state.name.startsWith(prefix)) out.push(await this.info(r));
    return out.sort((a, b) => a.name.localeCompare(b.name));
  }

  private async info(r: VmRecord): Promise<SandboxInfo> {
    const s = r.state;
    const paused = s.status === 'paused';
    const running = !paused && (await this.alive(s));
    const host = this.opts.advertiseHost ?? (this.opts.publishHost === '0.0.0.0' ? '127.0.0.1' : this.opts.publishHost);
    const endpoints: Endpoint[] = s.endpoints.map((e) => ({
      as: e.as,
      url: `${e.as === 'http' ? 'http' : e.protocol}://${host}:${e.host_port}`,
      port: e.port,
      protocol: e.protocol,
      host_port: e.host_port,
    }));
    return {
      name: s.name,
      state: paused ? 'paused' : running ? 'running' : 'stopped',
      tenant: s.tenant,
      image: s.image,
      checkpoint_id: s.checkpoint_id,
      ip: s.ip,
      mac: s.mac,
      cpus: s.cpus,
      ram_mb: s.ram_mb,
      pids_max: 0,
      created_at: s.created_at,
      init_pid: running ? s.pid : 0,
      endpoints,
      console_log: join(this.vmDir(s.name), 'serial.log'),
    };
  }

  private async alive(s: VmState): Promise<boolean> {
    return s.pid > 0 && (await processStartTime(s.pid)) === s.pid_start;
  }

  private target(s: VmState): GuestTarget {
    return { host: s.ip, port: GUEST_AGENT_PORT, token: s.token };
  }

  private async running(name: string): Promise<VmRecord> {
    const r = this.records.get(name);
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    if (r.state.status === 'paused' || !(await this.alive(r.state))) throw sandboxNotRunning(name);
    return r;
  }

  // ---- processes ----

  async spawn(name: string, opts: SpawnOptions): Promise<ProcessHandle> {
    const r = await this.running(name);
    if (!Array.isArray(opts.argv) || opts.argv.length === 0 || opts.argv.some((a) => typeof a !== 'string' || a.includes('\0'))) {
      throw invalidSpec('argv must be a non-empty list of strings without NUL bytes', [{ path: 'argv', message: 'invalid argv' }]);
    }
    const env: Record<string, string> = { PATH: DEFAULT_PATH, HOME: '/root', HOSTNAME: name, ...r.state.env, ...(opts.env ?? {}) };
    for (const [k, v] of Object.entries(env)) {
      if (!envKeyRe.test(k) || v.includes('\0')) {
        throw invalidSpec(`environment variable "${k}" is invalid`, [{ path: `env.${k}`, message: 'invalid name or value' }]);
      }
    }
    const cwd = opts.cwd ?? '/';
    if (!cwd.startsWith('/') || cwd.includes('\0'))
      throw invalidSpec('cwd must be an absolute guest path', [{ path: 'cwd', message: 'must start with /' }]);
    if (opts.tty && !('TERM' in env)) env.TERM = 'xterm-256color';
    try {
      return await guestSpawn(this.target(r.state), { ...opts, env, cwd });
    } catch (err) {
      throw sandboxFailed(`the in-guest agent of "${name}" did not answer: ${(err as Error).message}`, { vm: name }, err);
    }
  }

  // ---- files (through the in-guest agent: the guest's own view, so no host path is involved) ----

  resolveGuestPath(): Promise<string> {
    return Promise.reject(unsupportedByQemu('host paths into a VM (use writeGuestFile/readGuestFile)'));
  }

  async writeGuestFile(
    name: string,
    guestPath: string,
    data: Readable,
    opts: { mode?: number; maxBytes?: number } = {},
  ): Promise<{ path: string; bytes: number }> {
    const r = await this.running(name);
    checkGuestPath(guestPath);
    const mode = (opts.mode ?? 0o644) & 0o7777;
    const tmpName = `.fleet-upload-${randomBytes(6).toString('hex')}`;
    // Parent must exist (as for the process backend); temp file + rename inside the guest.
    const script = [
      'p="$1"; d=$(dirname "$p"); t="$d/$3"',
      '[ -d "$d" ] || exit 3',
      '[ -d "$p" ] && exit 4',
      'cat > "$t" || { rm -f "$t"; exit 5; }',
      'chmod "$2" "$t" && mv -f "$t" "$p" || { rm -f "$t"; exit 5; }',
    ].join('\n');
    const h = await this.spawn(name, { argv: ['sh', '-c', script, 'sh', guestPath, mode.toString(8), tmpName], stdin: true });
    // Mutated by the counting transform.
    const seen = { bytes: 0, tooLarge: false };
    const errOut: Buffer[] = [];
    h.stderr.on('data', (d: Buffer) => errOut.push(d));
    h.stdout.resume();
    const counter = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        seen.bytes += chunk.length;
        if (opts.maxBytes !== undefined && seen.bytes > opts.maxBytes) {
          seen.tooLarge = true;
          cb(new Error('too large'));
          return;
        }
        cb(null, chunk);
      },
    });
    try {
      await pipeline(data, counter, h.stdin);
    } catch (err) {
      h.kill('SIGKILL');
      await h.wait();
      const dir = guestPath.slice(0, guestPath.lastIndexOf('/')) || '/';
      await guestRun(this.target(r.state), ['rm', '-f', `${dir}/${tmpName}`]).catch(() => undefined);
      if (seen.tooLarge)
        throw new AppError('PAYLOAD_TOO_LARGE', 413, `the file is larger than ${opts.maxBytes} bytes`, { path: guestPath });
      throw err;
    }
    const st = await h.wait();
    if (st.exitCode === 3) throw guestPathNotFound(guestPath.slice(0, guestPath.lastIndexOf('/')) || '/');
    if (st.exitCode === 4)
      throw new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${guestPath}" is a directory in the sandbox; give a file path`, {
        path: guestPath,
      });
    if (st.exitCode !== 0) {
      throw sandboxFailed(`writing "${guestPath}" in VM "${name}" failed: ${Buffer.concat(errOut).toString().trim().slice(0, 300)}`, {
        vm: name,
      });
    }
    return { path: guestPath, bytes: seen.bytes };
  }

  async readGuestFile(name: string, guestPath: string): Promise<{ path: string; size: number; stream: Readable; done: Promise<void> }> {
    await this.running(name);
    checkGuestPath(guestPath);
    // One process: the size line comes from the descriptor cat then reads, so the two agree unless the file changes under it.
    const script = '[ -e "$1" ] || exit 3; [ -f "$1" ] || exit 4; exec 3<"$1" || exit 5; stat -L -c %s "$1"; exec cat <&3';
    const h = await this.spawn(name, { argv: ['sh', '-c', script, 'sh', guestPath], stdin: false });
    h.stderr.resume();
    let head: Buffer = Buffer.alloc(0);
    const size = await new Promise<number | null>((resolveSize) => {
      const onData = (d: Buffer): void => {
        head = Buffer.concat([head, d]);
        const nl = head.indexOf(10);
        if (nl < 0) return;
        h.stdout.off('data', onData);
        h.stdout.pause();
        const rest = head.subarray(nl + 1);
        if (rest.length) h.stdout.unshift(rest);
        resolveSize(Number(head.subarray(0, nl).toString()));
      };
      h.stdout.on('data', onData);
      void h.wait().then(() => resolveSize(null));
    });
    if (size === null || !Number.isSafeInteger(size)) {
      const st = await h.wait();
      if (st.exitCode === 3) throw guestPathNotFound(guestPath);
      if (st.exitCode === 4)
        throw new AppError('GUEST_PATH_NOT_A_FILE', 400, `"${guestPath}" is not a regular file in the sandbox`, { path: guestPath });
      throw sandboxFailed(`reading "${guestPath}" in VM "${name}" failed (exit ${st.exitCode})`, { vm: name });
    }
    let left = size;
    const limit = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        const take = chunk.subarray(0, Math.max(0, left));
        left -= take.length;
        cb(null, take.length ? take : undefined);
      },
    });
    const stream = new PassThrough();
    const done = pipeline(h.stdout, limit, stream).then(async () => {
      const st = await h.wait();
      if (left > 0 || st.exitCode !== 0) throw sandboxFailed(`reading "${guestPath}" ended early (exit ${st.exitCode})`, { vm: name });
    });
    done.catch(() => undefined);
    return { path: guestPath, size, stream, done };
  }

  // ---- destroy / stop ----

  async destroy(name: string, opts: DestroyOptions = {}): Promise<void> {
    if (!nameRe.test(name)) return;
    await this.locks.run(`vm:${name}`, async () => {
      const r = this.records.get(name) ?? (await this.readRecord(name));
      if (!r) {
        await rm(this.vmDir(name), { recursive: true, force: true });
        return;
      }
      if (opts.drainCommand && (await this.alive(r.state))) {
        await guestRun(this.target(r.state), ['sh', '-c', opts.drainCommand], {
          timeoutMs: opts.graceMs ?? 5_000,
          connectTimeoutMs: 2_000,
        }).catch((err: unknown) => this.log?.warn({ vm: name, err: (err as Error).message }, 'drain command failed'));
      }
      await this.teardown(r, opts);
      this.log?.info({ vm: name }, 'VM destroyed');
    });
  }

  /**
   * backend.go.txt Stop: ACPI power button (the guest's acpid powers off), then
   * SIGKILL once `graceMs` has passed. Resolves when QEMU is gone.
   */
  async stopVm(s: VmState, graceMs: number): Promise<'acpi' | 'killed' | 'gone'> {
    if (!(await this.alive(s))) return 'gone';
    if (graceMs > 0) {
      const asked = await qmp(this.qmpPath(s.name), 'system_powerdown').then(
        () => true,
        () => false,
      );
      const until = Date.now() + graceMs;
      while (asked && Date.now() < until) {
        if (!(await this.alive(s))) return 'acpi';
        await sleep(100);
      }
    }
    if (await this.alive(s)) {
      try {
        process.kill(s.pid, 'SIGKILL');
      } catch {
        // gone between the check and the kill
      }
    }
    for (let i = 0; i < 100 && (await this.alive(s)); i++) await sleep(50);
    return 'killed';
  }

  private async teardown(r: VmRecord, opts: DestroyOptions): Promise<void> {
    const s = r.state;
    // A post-copy source still feeds its guest on the target: it goes once the last page has.
    if (r.draining) await r.draining;
    for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
    // A stopped guest (paused, or frozen after a migration) cannot answer the power button.
    await this.stopVm(s, s.status === 'paused' ? 0 : (opts.graceMs ?? 5_000));
    await r.console?.close().catch(() => undefined);
    if (r.incoming) clearTimeout(r.incoming.timer);
    r.console = undefined;
    await rm(this.qmpPath(s.name), { force: true });
    await rm(this.serialPath(s.name), { force: true });
    await rm(this.controlPath(s.name), { force: true });
    if (s.paused_checkpoint) await this.store.delete(s.paused_checkpoint).catch(() => undefined);
    await runTool('ip', ['route', 'del', `${s.ip}/32`, 'dev', s.bridge]);
    await runTool('ip', ['link', 'del', s.tap]);
    this.records.delete(s.name);
    await this.firewall.apply(() => this.firewallState());
    if (![...this.records.values()].some((o) => o.state.bridge === s.bridge)) await runTool('ip', ['link', 'del', s.bridge]);
    await rm(this.vmDir(s.name), { recursive: true, force: true });
  }

  // ---- state on disk ----

  private async writeState(s: VmState): Promise<void> {
    const file = join(this.vmDir(s.name), 'state.json');
    await writeFile(`${file}.tmp`, `${JSON.stringify(s)}\n`, { mode: 0o600 });
    await rename(`${file}.tmp`, file);
  }

  private async readRecord(name: string): Promise<VmRecord | null> {
    const raw = await readFile(join(this.vmDir(name), 'state.json'), 'utf8').catch(() => null);
    if (raw === null) return null;
    try {
      return { state: stateSchema.parse(JSON.parse(raw)), proxies: [] };
    } catch {
      return null;
    }
  }

  /** Rediscovers VMs from their state files; a QEMU still running keeps its VM, and its endpoints are published again. */
  async recover(): Promise<SandboxInfo[]> {
    const names = await readdir(this.vmsDir).catch(() => [] as string[]);
    for (const name of names) {
      if (!nameRe.test(name) || this.records.has(name) || this.creating.has(name)) continue;
      const r = await this.readRecord(name);
      // Half-created VMs (the agent died mid-create) are left for prune.
      if (!r || r.state.status === 'creating') continue;
      this.records.set(name, r);
      if (r.state.status === 'running' && (await this.alive(r.state))) {
        const status = await qmp(this.qmpPath(name), 'query-status').catch(() => null);
        if (!status) this.log?.warn({ vm: name }, 'QEMU is alive but its QMP socket does not answer');
        await this.startConsole(r).catch((err: unknown) => this.log?.warn({ vm: name, err: (err as Error).message }, 'no serial console'));
        await this.publish(r).catch((err: unknown) =>
          this.log?.warn({ vm: name, err: (err as Error).message }, 'could not republish endpoints'),
        );
      }
    }
    if (this.records.size > 0) await this.firewall.apply(() => this.firewallState());
    return this.list();
  }

  private firewallState(): FirewallState {
    const states = [...this.records.values()].map((r) => r.state);
    return { bridges: [...new Set(states.map((s) => s.bridge))], ports: states.map((s) => ({ veth: s.tap, mac: s.mac, ip: s.ip })) };
  }

  // ---- prune (backend.go.txt Reconcile) ----

  async prune(): Promise<PruneReport> {
    const report = {
      bridges: [] as string[],
      veths: [] as string[],
      mounts: [] as string[],
      loopDevices: [] as string[],
      directories: [] as string[],
      cgroups: [] as string[],
      processes: [] as number[],
      tables: [] as string[],
      errors: [] as string[],
    };
    await this.locks.run('alloc', async () => {
      const known = [...this.records.values()].map((r) => r.state);
      // QEMUs of this agent (by their -pidfile under our vms dir) that no live VM owns.
      for (const p of await this.ourQemuProcesses()) {
        const owner = known.find((s) => s.name === p.name);
        if (owner && owner.pid === p.pid) continue;
        if (this.creating.has(p.name)) continue;
        try {
          process.kill(p.pid, 'SIGKILL');
          report.processes.push(p.pid);
        } catch (err) {
          report.errors.push(`kill ${p.pid}: ${(err as Error).message}`);
        }
      }
      for (const name of await readdir(this.vmsDir).catch(() => [] as string[])) {
        if (known.some((s) => s.name === name) || this.creating.has(name)) continue;
        await rm(this.vmDir(name), { recursive: true, force: true });
        report.directories.push(this.vmDir(name));
      }
      const sockets = new Set(known.flatMap((s) => [this.qmpPath(s.name), this.serialPath(s.name), this.controlPath(s.name)]));
      for (const n of this.creating) sockets.add(this.qmpPath(n)).add(this.serialPath(n)).add(this.controlPath(n));
      for (const f of await readdir(this.runDir).catch(() => [] as string[])) {
        const path = join(this.runDir, f);
        if (sockets.has(path)) continue;
        await rm(path, { force: true });
        report.directories.push(path);
      }
      const links = await listAllLinks();
      for (const l of links) {
        if (this.tapRe().test(l) && !known.some((s) => s.tap === l)) {
          if ((await runTool('ip', ['link', 'del', l])).code === 0) report.veths.push(l);
        }
      }
      for (const l of links) {
        if (this.bridgeRe().test(l) && !known.some((s) => s.bridge === l)) {
          if ((await runTool('ip', ['link', 'del', l])).code === 0) report.bridges.push(l);
        }
      }
      if (known.length === 0) {
        const had = await this.firewall.reassert(() => this.firewallState()).catch(() => [] as string[]);
        if (had.length > 0) report.tables.push(...this.firewall.tables);
      }
    });
    return report;
  }

  private async ourQemuProcesses(): Promise<Array<{ pid: number; name: string }>> {
    const out: Array<{ pid: number; name: string }> = [];
    for (const entry of await readdir('/proc').catch(() => [] as string[])) {
      if (!/^\d+$/.test(entry)) continue;
      const argv = (await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '')).split('\0');
      const i = argv.indexOf('-pidfile');
      const pidfile = i >= 0 ? argv[i + 1] : undefined;
      if (!pidfile?.startsWith(`${this.vmsDir}/`)) continue;
      const name = pidfile.slice(this.vmsDir.length + 1).split('/')[0] ?? '';
      out.push({ pid: Number(entry), name });
    }
    return out;
  }

  async reassertNetwork(): Promise<NetworkReassertReport> {
    const repairs: string[] = [];
    for (const r of this.records.values()) {
      repairs.push(...(await hardenLink(r.state.bridge, 'bridge')), ...(await hardenLink(r.state.tap, 'veth')));
    }
    repairs.push(...(await this.firewall.reassert(() => this.firewallState())));
    return { repaired: repairs.length, repairs };
  }

  async close(): Promise<void> {
    this.closed = true;
    for (const r of this.records.values()) {
      for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
      await r.console?.close().catch(() => undefined);
      r.console = undefined;
    }
  }

  // ---- memory state (state.ts): checkpoints, pause and resume, restores, forks ----

  private machineMeta(s: VmState, build: string): QemuMeta {
    return {
      format: 1,
      cpus: Math.max(1, Math.ceil(s.cpus)),
      ram_mb: s.ram_mb,
      disk_bytes: s.disk_bytes,
      accel: s.accel,
      qemu_version: this.qemuVersion,
      image_build: build,
      image: s.image,
      name: s.name,
      ip: s.ip,
      mac: s.mac,
    };
  }

  private scratchDir(name: string): string {
    return join(this.store.staging, `.qemu-${name}-${randomBytes(4).toString('hex')}`);
  }

  /**
   * Disk (`live` false, or a VM that is not running) or disk plus memory:
   * the guest is stopped for the copy of its overlay and the write of its
   * state, then runs on. `pause_ms` is how long it was stopped.
   */
  async checkpoint(name: string, opts: CheckpointOptions): Promise<Checkpoint> {
    const r = this.records.get(name);
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    return this.locks.run(`vm:${name}`, async () => {
      const s = r.state;
      const running = s.status === 'running' && (await this.alive(s));
      const scratch = this.scratchDir(name);
      try {
        let pauseMs = 0;
        let memory = false;
        if (running) {
          const got = await capture({
            qmpPath: this.qmpPath(name),
            diskPath: join(this.vmDir(name), DISK_FILE),
            scratch,
            memory: opts.live === true,
            leaveStopped: false,
            timeoutMs: 120_000,
          });
          pauseMs = got.pauseMs;
          memory = got.memory;
        } else {
          // No QEMU holds the disk (paused): its overlay is already one instant.
          await mkdir(scratch, { recursive: true, mode: 0o700 });
          await mustRun('cp', ['--sparse=always', '--reflink=auto', join(this.vmDir(name), DISK_FILE), join(scratch, DISK_FILE)]);
        }
        const image = await resolveQemuImage(this.opts.imageDir, s.image);
        const cp = await writeCheckpoint(this.store, scratch, {
          ...(opts.id ? { id: opts.id } : {}),
          ...(opts.maxBytes ? { maxBytes: opts.maxBytes } : {}),
          comment: opts.comment ?? '',
          image: s.image,
          now: new Date(),
          machine: this.machineMeta(s, await imageBuild(image)),
          memory,
        });
        this.log?.info({ vm: name, checkpoint: cp.id, kind: cp.kind, pause_ms: pauseMs }, 'checkpoint taken');
        return { ...cp, pause_ms: pauseMs };
      } finally {
        await rm(scratch, { recursive: true, force: true });
      }
    });
  }

  /**
   * A live checkpoint, then QEMU ends: the VM's CPU and memory are free, its
   * disk, tap and address kept (state `paused`) until resume() or destroy().
   * The checkpoint is an ordinary live one: it can move, and be resumed
   * under another name elsewhere (create with resume).
   */
  async pause(name: string, opts: { id?: string; comment?: string } = {}): Promise<Checkpoint> {
    const r = this.records.get(name);
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    return this.locks.run(`vm:${name}`, async () => {
      const s = r.state;
      if (s.status === 'paused' && !s.paused_checkpoint) {
        throw new AppError('VM_FROZEN', 409, `VM "${name}" is frozen after a live migration: resume or destroy it`, { name });
      }
      if (s.status === 'paused') return { ...(await this.store.get(s.paused_checkpoint)), pause_ms: 0 };
      if (!(await this.alive(s))) throw sandboxNotRunning(name);
      const scratch = this.scratchDir(name);
      let cp: Checkpoint;
      let pauseMs: number;
      try {
        const got = await capture({
          qmpPath: this.qmpPath(name),
          diskPath: join(this.vmDir(name), DISK_FILE),
          scratch,
          memory: true,
          leaveStopped: true,
          timeoutMs: 120_000,
        });
        pauseMs = got.pauseMs;
        const image = await resolveQemuImage(this.opts.imageDir, s.image);
        cp = await writeCheckpoint(this.store, scratch, {
          ...(opts.id ? { id: opts.id } : {}),
          comment: opts.comment ?? 'pause',
          image: s.image,
          now: new Date(),
          machine: this.machineMeta(s, await imageBuild(image)),
          memory: true,
        });
      } catch (err) {
        // Nothing was kept: the guest runs on as it was.
        await qmp(this.qmpPath(name), 'cont').catch(() => undefined);
        throw err;
      } finally {
        await rm(scratch, { recursive: true, force: true });
      }
      for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
      // Stopped and captured: nothing the guest does is lost by ending QEMU now.
      await this.stopVm(s, 0);
      await r.console?.close().catch(() => undefined);
      r.console = undefined;
      s.status = 'paused';
      s.paused_checkpoint = cp.id;
      s.pid = 0;
      s.pid_start = '';
      await this.writeState(s);
      this.log?.info({ vm: name, checkpoint: cp.id, pause_ms: pauseMs }, 'VM paused');
      return { ...cp, pause_ms: pauseMs };
    });
  }

  /** Loads a paused VM's state into a new QEMU over its own disk (idempotent: a running VM is answered as it is). */
  async resume(name: string): Promise<SandboxInfo> {
    const r = this.records.get(name);
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    return this.locks.run(`vm:${name}`, async () => {
      const s = r.state;
      if (s.status === 'running') return this.info(r);
      if (!s.paused_checkpoint) return this.thaw(r);
      const cp = await this.store.get(s.paused_checkpoint);
      const image = await resolveQemuImage(this.opts.imageDir, s.image);
      await this.checkMachine(cp, await readMeta(this.store, cp), image);
      try {
        await this.plugNetwork(s);
        await this.loadInto(r, cp, image, Date.now());
      } catch (err) {
        // Still paused, its checkpoint kept: resume can be asked again.
        await this.stopVm(s, 0).catch(() => undefined);
        await r.console?.close().catch(() => undefined);
        r.console = undefined;
        s.pid = 0;
        s.pid_start = '';
        await this.writeState(s);
        throw err;
      }
      await this.publish(r);
      s.status = 'running';
      s.paused_checkpoint = '';
      await this.writeState(s);
      await this.store
        .delete(cp.id)
        .catch((err: unknown) => this.log?.warn({ err, checkpoint: cp.id }, 'could not remove the pause checkpoint'));
      return this.info(r);
    });
  }

  /**
   * Puts a VM (running or paused) back to a checkpoint of this host: QEMU
   * ends, the disk becomes the checkpoint's; a live one then loads its state
   * (any VM's, re-addressed as this one), a disk one boots afresh.
   */
  async restoreCheckpoint(name: string, checkpointId: string): Promise<SandboxInfo> {
    const r = this.records.get(name);
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    return this.locks.run(`vm:${name}`, async () => {
      const s = r.state;
      const cp = await this.store.get(checkpointId);
      if (cp.image !== s.image) {
        throw invalidSpec(`checkpoint "${cp.id}" sits on image "${cp.image}", the VM on "${s.image}"`, [
          { path: 'checkpoint_id', message: 'another image' },
        ]);
      }
      const image = await resolveQemuImage(this.opts.imageDir, s.image);
      const meta = cp.kind === 'live' ? await readMeta(this.store, cp) : undefined;
      if (meta) {
        await this.checkMachine(cp, meta, image);
        if (meta.ram_mb !== s.ram_mb || meta.cpus !== Math.max(1, Math.ceil(s.cpus)) || meta.disk_bytes !== s.disk_bytes) {
          throw invalidSpec(`checkpoint "${cp.id}" holds the memory of a VM of another size than "${name}"`, [
            { path: 'checkpoint_id', message: 'another machine size' },
          ]);
        }
        await verifyState(this.store, cp);
      }
      for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
      await this.stopVm(s, 0);
      await r.console?.close().catch(() => undefined);
      r.console = undefined;
      const started = Date.now();
      await this.diskFromCheckpoint(s, cp, image);
      await this.plugNetwork(s);
      // A restored copy of a past state is not the VM that ran on from it: a new generation id.
      s.vmgenid = randomUUID();
      if (meta) {
        await this.loadInto(r, cp, image, started);
      } else {
        await this.launch(s, image);
        await this.writeState(s);
        await this.startConsole(r);
        await this.waitForGuest(s, started);
      }
      const paused = s.paused_checkpoint;
      s.status = 'running';
      s.paused_checkpoint = '';
      s.checkpoint_id = cp.id;
      await this.publish(r);
      await this.writeState(s);
      if (paused && paused !== cp.id) await this.store.delete(paused).catch(() => undefined);
      return this.info(r);
    });
  }

  /** The checkpoint's overlay (digest checked while extracted) becomes the VM's disk, over this host's copy of its image. */
  private async diskFromCheckpoint(s: VmState, cp: Checkpoint, image: QemuImage): Promise<void> {
    const dir = this.vmDir(s.name);
    const tmp = join(dir, `.restore-${randomBytes(4).toString('hex')}`);
    await mkdir(tmp, { mode: 0o700 });
    try {
      await this.store.extract(cp.id, tmp);
      // The overlay names its base by the capturing host's path: point it at ours (same build, checkMachine saw to it).
      await mustRun('qemu-img', ['rebase', '-u', '-q', '-f', 'qcow2', '-b', image.rootfs, '-F', 'qcow2', join(tmp, DISK_FILE)]);
      await rename(join(tmp, DISK_FILE), join(dir, DISK_FILE));
    } finally {
      await rm(tmp, { recursive: true, force: true });
    }
  }

  /**
   * QEMU with `-incoming defer -S`, the checkpoint's state loaded into it
   * (its sha256 checked first), run; then the guest is told who it is now
   * over its control channel and must answer on its address.
   */
  private async loadInto(r: VmRecord, cp: Checkpoint, image: QemuImage, started: number): Promise<void> {
    const s = r.state;
    const file = await verifyState(this.store, cp);
    await this.launch(s, image, { incoming: true });
    await this.writeState(s);
    await this.startConsole(r);
    await loadState(this.qmpPath(s.name), file, 120_000, () => this.alive(s));
    // The host may remember another MAC for this address (a VM that had it before).
    await runTool('ip', ['neigh', 'del', s.ip, 'dev', s.bridge]);
    await qmp(this.qmpPath(s.name), 'cont');
    await sendIdentity(this.controlPath(s.name), {
      ip: s.ip,
      prefixLen: this.subnet.prefixLen,
      gateway: this.subnet.gateway,
      mac: s.mac,
      hostname: s.name,
      token: s.token,
      epochS: Date.now() / 1000,
    });
    await this.waitForGuest(s, started);
    this.log?.info({ vm: s.name, checkpoint: cp.id, restore_ms: Date.now() - started }, 'VM state loaded');
  }

  /** A frozen VM (QEMU alive, stopped: after keep_paused, or a source whose migration the caller rolls back) runs on. */
  private async thaw(r: VmRecord): Promise<SandboxInfo> {
    const s = r.state;
    if (!(await this.alive(s))) throw sandboxNotRunning(s.name);
    const started = Date.now();
    await qmp(this.qmpPath(s.name), 'cont');
    if (!r.console) await this.startConsole(r).catch(() => undefined);
    await sendIdentity(this.controlPath(s.name), this.identity(s));
    await this.waitForGuest(s, started);
    await this.publish(r);
    s.status = 'running';
    await this.writeState(s);
    return this.info(r);
  }

  private identity(s: VmState): Parameters<typeof sendIdentity>[1] {
    return {
      ip: s.ip,
      prefixLen: this.subnet.prefixLen,
      gateway: this.subnet.gateway,
      mac: s.mac,
      hostname: s.name,
      token: s.token,
      epochS: Date.now() / 1000,
    };
  }

  // ---- native live migration (backend.ts sendMigration; agent-protocol migration.ts) ----

  /** The machine a target must build to receive this VM's stream. */
  async migrationOffer(name: string): Promise<Record<string, unknown>> {
    const r = await this.running(name);
    return this.machineMeta(r.state, await imageBuild(await resolveQemuImage(this.opts.imageDir, r.state.image)));
  }

  /**
   * The target's half: the VM is allocated here (its own address, MAC, tap,
   * seed and token), an empty overlay over the same image build, and a QEMU
   * waiting with `-incoming defer` behind TLS with a fresh pre-shared key;
   * answers where and with which key the source may send.
   */
  async prepareIncoming(
    input: CreateSpec,
    machine: Record<string, unknown>,
    opts: { ttlMs: number; lazy?: boolean },
  ): Promise<MigrationTarget> {
    if (this.closed) throw sandboxFailed('the qemu backend is closed');
    if (input.egress && input.egress.mode !== 'none')
      throw unsupportedByQemu(`egress mode "${input.egress.mode}" (create with egress {"mode":"none"})`);
    const parsed = createSpecSchema.safeParse(input);
    if (!parsed.success) {
      throw invalidSpec(
        `invalid sandbox spec: ${parsed.error.issues.map((i) => `${i.path.join('.') || '(spec)'}: ${i.message}`).join('; ')}`,
        parsed.error.issues.map((i) => ({ path: i.path.join('.'), message: i.message })),
      );
    }
    const spec = parsed.data;
    if (spec.checkpointId || spec.resume)
      throw invalidSpec('a migrated VM comes from its stream, not a checkpoint', [
        { path: 'checkpoint_id', message: 'not with a migration' },
      ]);
    const m = qemuMetaSchema.safeParse(machine);
    if (!m.success) throw invalidSpec('machine is not a qemu migration offer', [{ path: 'machine', message: 'not a qemu offer' }]);
    const meta = m.data;
    this.checkSize(spec, meta, 'the source VM');
    if (meta.image && spec.image && meta.image !== spec.image) {
      throw invalidSpec(`the source VM runs image "${meta.image}", not "${spec.image}"`, [
        { path: 'image', message: 'conflicts with the source' },
      ]);
    }
    return this.locks.run(`vm:${spec.name}`, async () => {
      if (this.records.has(spec.name) || this.creating.has(spec.name)) throw sandboxExists(spec.name);
      const image = await resolveQemuImage(this.opts.imageDir, meta.image ?? spec.image ?? this.opts.defaultImage);
      const why = await this.machineMismatch(meta, image);
      if (why) throw new AppError('MIGRATION_INCOMPATIBLE', 409, `VM "${spec.name}" cannot migrate here: ${why}`, { name: spec.name });
      this.creating.add(spec.name);
      let record: VmRecord | undefined;
      try {
        record = await this.allocate(spec, image, meta.disk_bytes, '');
        const s = record.state;
        const dir = this.vmDir(s.name);
        await this.plugNetwork(s);
        await this.firewall.apply(() => this.firewallState());
        // The stream carries the source overlay's blocks (block-incremental) onto an empty overlay over the same base.
        await mustRun('qemu-img', [
          'create',
          '-q',
          '-f',
          'qcow2',
          '-b',
          image.rootfs,
          '-F',
          'qcow2',
          join(dir, DISK_FILE),
          String(s.disk_bytes),
        ]);
        await this.writeSeed(s);
        const psk = randomBytes(32).toString('hex');
        const pskDir = await writePsk(dir, 'mig-in', psk);
        record.incoming = { pskDir, timer: setTimeout(() => void this.expireIncoming(s.name), opts.ttlMs) };
        record.incoming.timer.unref();
        await this.launch(s, image, { incoming: true });
        await this.writeState(s);
        await this.startConsole(record);
        const q = this.qmpPath(s.name);
        await qmp(q, 'object-add', { 'qom-type': 'tls-creds-psk', id: MIG_TLS, endpoint: 'server', dir: pskDir });
        await qmp(q, 'migrate-set-parameters', { 'tls-creds': MIG_TLS });
        if (opts.lazy) await qmp(q, 'migrate-set-capabilities', { capabilities: [{ capability: 'postcopy-ram', state: true }] });
        await qmp(q, 'migrate-incoming', { uri: `tcp:${this.opts.publishHost}:0` });
        const st = (await qmp(q, 'query-migrate')) as { 'socket-address'?: Array<{ port?: string | number }> };
        const port = Number(st['socket-address']?.[0]?.port ?? 0);
        if (!port) throw sandboxFailed('QEMU did not say which port it listens on for the migration');
        const host = this.opts.advertiseHost ?? (this.opts.publishHost === '0.0.0.0' ? '127.0.0.1' : this.opts.publishHost);
        this.log?.info({ vm: s.name, port }, 'waiting for a live migration');
        return { uri: `tcp:${host}:${port}`, psk, expires_at: new Date(Date.now() + opts.ttlMs).toISOString() };
      } catch (err) {
        if (record) await this.teardown(record, { graceMs: 0 }).catch(() => undefined);
        else this.records.delete(spec.name);
        this.creating.delete(spec.name);
        throw err instanceof AppError
          ? err
          : sandboxFailed(`preparing the migration of "${spec.name}" failed: ${(err as Error).message}`, {}, err);
      }
    });
  }

  private async expireIncoming(name: string): Promise<void> {
    await this.locks.run(`vm:${name}`, async () => {
      const r = this.records.get(name);
      if (!r?.incoming) return;
      this.log?.warn({ vm: name }, 'no live migration landed in time: what was prepared for it is removed');
      await this.teardown(r, { graceMs: 0 }).catch(() => undefined);
      this.creating.delete(name);
    });
  }

  /**
   * The source's half: the guest's memory and its overlay's blocks stream to
   * the target in TLS under the key the target minted (a listener without it
   * gets a failed handshake, never a byte of the guest). Completed, the
   * source stays stopped (`paused`): destroy it, or resume it if the target
   * failed. A failed send leaves the source running.
   */
  async sendMigration(name: string, to: { uri: string; psk: string }, opts: { lazy?: boolean } = {}): Promise<MigrationSendReport> {
    const lazy = opts.lazy === true;
    if (lazy && !this.lazyPages)
      throw new AppError('LAZY_MIGRATION_UNSUPPORTED', 409, 'this host has no userfaultfd: post-copy is not possible');
    const r = await this.running(name);
    if (!/^tcp:[A-Za-z0-9.-]{1,253}:\d{1,5}$/.test(to.uri) || !/^[0-9a-f]{64}$/.test(to.psk)) {
      throw invalidSpec('to.uri must be tcp:<host>:<port> and to.psk 64 hex digits', [{ path: 'to', message: 'invalid target' }]);
    }
    return this.locks.run(`vm:${name}`, async () => {
      const s = r.state;
      if (s.status !== 'running' || !(await this.alive(s))) throw sandboxNotRunning(name);
      const q = this.qmpPath(name);
      const pskDir = await writePsk(this.vmDir(name), 'mig-out', to.psk);
      let st: Awaited<ReturnType<typeof waitMigration>>;
      try {
        await qmp(q, 'object-del', { id: MIG_TLS }).catch(() => undefined);
        await qmp(q, 'object-add', { 'qom-type': 'tls-creds-psk', id: MIG_TLS, endpoint: 'client', dir: pskDir, username: PSK_USER });
        await qmp(q, 'migrate-set-capabilities', {
          capabilities: [
            { capability: 'block', state: true },
            { capability: 'postcopy-ram', state: lazy },
          ],
        });
        await qmp(q, 'migrate-set-parameters', { 'tls-creds': MIG_TLS, 'block-incremental': true, 'max-bandwidth': 8 * 1024 ** 3 });
        const t0 = Date.now();
        await qmp(q, 'migrate', { uri: to.uri });
        if (lazy) {
          st = await switchToPostcopy(q, 600_000, () => this.alive(s));
          st = { ...st, downtime: st.downtime ?? Date.now() - t0 };
        } else {
          st = await waitMigration(q, 600_000, () => this.alive(s));
        }
      } catch (err) {
        // QEMU resumed the guest itself (it was running): only our settings are undone.
        await qmp(q, 'migrate-set-parameters', { 'tls-creds': '', 'block-incremental': false }).catch(() => undefined);
        await qmp(q, 'object-del', { id: MIG_TLS }).catch(() => undefined);
        throw new AppError('MIGRATION_FAILED', 424, `the live migration of "${name}" failed; it runs on here: ${(err as Error).message}`, {
          name,
        });
      } finally {
        await rm(pskDir, { recursive: true, force: true });
      }
      for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
      s.status = 'paused';
      s.paused_checkpoint = '';
      await this.writeState(s);
      if (lazy) {
        // The guest runs on the target now; the rest of its memory still comes from here.
        r.draining = waitMigration(q, 3_600_000, () => this.alive(s)).then(
          () => this.log?.info({ vm: name }, 'post-copy migration complete: the source is no longer needed'),
          (err: unknown) =>
            this.log?.error({ vm: name, err: (err as Error).message }, 'post-copy migration failed: the target guest is lost'),
        );
      }
      const report = {
        downtime_ms: st.downtime ?? 0,
        total_ms: st['total-time'] ?? 0,
        transferred_bytes: (st.ram?.transferred ?? 0) + (st.disk?.transferred ?? 0),
        ...(lazy ? { lazy: true } : {}),
      };
      this.log?.info({ vm: name, ...report }, 'live migration sent');
      return report;
    });
  }

  /** The target's last step: the stream has landed; the guest is told who it is here and runs (or stays frozen: keepPaused). */
  async completeIncoming(name: string, opts: { keepPaused: boolean }): Promise<SandboxInfo> {
    return this.locks.run(`vm:${name}`, async () => {
      const r = this.records.get(name);
      if (!r?.incoming) throw new AppError('MIGRATION_NOT_FOUND', 404, `no live migration of "${name}" is waiting on this host`, { name });
      const s = r.state;
      const incoming = r.incoming;
      try {
        await waitIncoming(this.qmpPath(name), 60_000, () => this.alive(s));
        clearTimeout(incoming.timer);
        r.incoming = undefined;
        const q = this.qmpPath(name);
        await qmp(q, 'migrate-set-parameters', { 'tls-creds': '' }).catch(() => undefined);
        await qmp(q, 'object-del', { id: MIG_TLS }).catch(() => undefined);
        await rm(incoming.pskDir, { recursive: true, force: true });
        await runTool('ip', ['neigh', 'del', s.ip, 'dev', s.bridge]);
        s.status = 'paused';
        if (opts.keepPaused) {
          await this.writeState(s);
          return await this.info(r);
        }
        return await this.thaw(r);
      } catch (err) {
        await this.teardown(r, { graceMs: 0 }).catch(() => undefined);
        throw err;
      } finally {
        this.creating.delete(name);
      }
    });
  }

  /** The overlay's allocated bytes; a checkpoint's rootfs.tar is that file (sparse) plus tar's framing. */
  async layerUsage(name: string): Promise<LayerUsageReport> {
    const r = this.records.get(name);
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    const st = await stat(join(this.vmDir(name), DISK_FILE));
    const used = st.blocks * 512;
    return {
      used_bytes: used,
      entries: 1,
      limit_bytes: r.state.disk_bytes,
      expected_archive_bytes: expectedArchiveBytes({ used_bytes: Math.max(used, st.size), entries: 1 }),
    };
  }
  listCheckpoints(): Promise<Checkpoint[]> {
    return this.store.list();
  }
  getCheckpoint(id: string): Promise<Checkpoint> {
    return this.store.get(id);
  }
  deleteCheckpoint(id: string): Promise<void> {
    return this.store.delete(id);
  }
  async checkpointDir(id: string): Promise<string> {
    await this.store.get(id);
    return this.store.path(id);
  }
  stagingDir(): string {
    return this.store.staging;
  }
  importCheckpoint(stagingPath: string, opts: { verifyDigest?: boolean } = {}): Promise<Checkpoint> {
    return this.store.import(stagingPath, opts);
  }
}

function checkGuestPath(p: string): void {
  if (!p.startsWith('/') || p.includes('\0') || p.endsWith('/')) {
    throw invalidSpec(`"${p}" is not an absolute file path in the guest`, [{ path: 'path', message: 'must be an absolute file path' }]);
  }
}

async function listAllLinks(): Promise<string[]> {
  const res = await runTool('ip', ['-j', 'link', 'show']);
  if (res.code !== 0) return [];
  try {
    return (JSON.parse(res.stdout) as Array<{ ifname: string }>).map((l) => l.ifname.replace(/@.*$/, ''));
  } catch {
    return [];
  }
}

/** Identifies one build of an image (image.json carries its build time): a qcow2 delta is valid only over that build. */
async function imageBuild(image: QemuImage): Promise<string> {
  return createHash('sha256')
    .update(await readFile(join(image.dir, 'image.json')))
    .digest('hex');
}

async function virtualSize(path: string): Promise<number> {
  const out = await mustRun('qemu-img', ['info', '--output=json', '-U', path]);
  return (JSON.parse(out) as { 'virtual-size': number })['virtual-size'];
}

const MIG_TLS = 'fleet-migration-tls';
const PSK_USER = 'fleet';

/** QEMU's tls-creds-psk reads `<dir>/keys.psk` ("user:hexkey"): a directory of its own, 0700, removed after use. */
async function writePsk(vmDir: string, name: string, psk: string): Promise<string> {
  const dir = join(vmDir, name);
  await rm(dir, { recursive: true, force: true });
  await mkdir(dir, { mode: 0o700 });
  await writeFile(join(dir, 'keys.psk'), `${PSK_USER}:${psk}\n`, { mode: 0o600 });
  return dir;
}
