import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { readFile, rename, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { Logger } from 'pino';
import { type Endpoint, type SandboxInfo, sandboxNotFound, sandboxNotRunning } from '../../backend.js';
import { KeyedMutex, processStartTime } from '../process/exec-util.js';
import { Firewall, type FirewallState } from '../process/firewall.js';
import type { Subnet } from '../process/network.js';
import type { AccelReport } from './accel.js';
import { ConsoleLog } from './console.js';
import type { GuestTarget } from './guest-client.js';
import { GUEST_AGENT_PORT } from './image.js';
import { sendIdentity } from './control.js';
import type { QemuMeta } from './state.js';
import { CheckpointStore } from '../process/checkpoints.js';
import { nameHash, type QemuBackendOptions, stateSchema, type VmRecord, type VmState } from './vm-state.js';

/** What every part of the qemu backend shares: the VM records, locks, paths, the read side (info, liveness) and state.json. */
export class QemuHost {
  readonly records = new Map<string, VmRecord>();
  readonly creating = new Set<string>();
  readonly locks = new KeyedMutex();
  readonly vmsDir: string;
  readonly runDir: string;
  closed = false;
  /** Post-copy needs userfaultfd in the target's kernel (QEMU runs as root: the unprivileged switch does not matter). */
  readonly lazyPages = existsSync('/proc/sys/vm/unprivileged_userfaultfd');

  constructor(
    readonly opts: QemuBackendOptions & { bootTimeoutMs: number; qemuBinary: string },
    readonly subnet: Subnet,
    readonly firewall: Firewall,
    readonly accel: AccelReport,
    readonly log: Logger | undefined,
    readonly store: CheckpointStore,
    readonly qemuVersion: string,
  ) {
    this.vmsDir = join(opts.dataDir, 'qemu', 'vms');
    this.runDir = join(opts.dataDir, 'qemu', 'run');
  }

  vmDir(name: string): string {
    return join(this.vmsDir, name);
  }

  qmpPath(name: string): string {
    return join(this.runDir, `${nameHash(name)}.qmp`);
  }

  serialPath(name: string): string {
    return join(this.runDir, `${nameHash(name)}.serial`);
  }

  controlPath(name: string): string {
    return join(this.runDir, `${nameHash(name)}.ctl`);
  }

  async startConsole(r: VmRecord): Promise<void> {
    await r.console?.close();
    r.console = await ConsoleLog.start({
      socketPath: this.serialPath(r.state.name),
      logPath: join(this.vmDir(r.state.name), 'serial.log'),
      maxBytes: this.opts.consoleLogMaxBytes ?? 16 * 1024 * 1024,
      running: () => this.alive(r.state),
    });
  }

  processName(name: string): string {
    return `fleet:${this.opts.bridgePrefix}:${name}`;
  }

  bridgeStem(): string {
    return `${this.opts.bridgePrefix}v`;
  }

  tapRe(): RegExp {
    return new RegExp(`^${this.opts.bridgePrefix}vt\\d+$`);
  }

  bridgeRe(): RegExp {
    return new RegExp(`^${this.opts.bridgePrefix}vb(\\d+|shared)$`);
  }

  async serialTail(name: string): Promise<string> {
    const text = await readFile(join(this.vmDir(name), 'serial.log'), 'utf8').catch(() => '');
    return text.slice(-600).trim() || '(serial console empty)';
  }

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

  async info(r: VmRecord): Promise<SandboxInfo> {
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

  async alive(s: VmState): Promise<boolean> {
    return s.pid > 0 && (await processStartTime(s.pid)) === s.pid_start;
  }

  target(s: VmState): GuestTarget {
    return { host: s.ip, port: GUEST_AGENT_PORT, token: s.token };
  }

  async running(name: string): Promise<VmRecord> {
    const r = this.records.get(name);
    if (!r || r.state.status === 'creating') throw sandboxNotFound(name);
    if (r.state.status === 'paused' || !(await this.alive(r.state))) throw sandboxNotRunning(name);
    return r;
  }

  async writeState(s: VmState): Promise<void> {
    const file = join(this.vmDir(s.name), 'state.json');
    await writeFile(`${file}.tmp`, `${JSON.stringify(s)}\n`, { mode: 0o600 });
    await rename(`${file}.tmp`, file);
  }

  async readRecord(name: string): Promise<VmRecord | null> {
    const raw = await readFile(join(this.vmDir(name), 'state.json'), 'utf8').catch(() => null);
    if (raw === null) return null;
    try {
      return { state: stateSchema.parse(JSON.parse(raw)), proxies: [] };
    } catch {
      return null;
    }
  }

  firewallState(): FirewallState {
    const states = [...this.records.values()].map((r) => r.state);
    return { bridges: [...new Set(states.map((s) => s.bridge))], ports: states.map((s) => ({ veth: s.tap, mac: s.mac, ip: s.ip })) };
  }

  machineMeta(s: VmState, build: string): QemuMeta {
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

  scratchDir(name: string): string {
    return join(this.store.staging, `.qemu-${name}-${randomBytes(4).toString('hex')}`);
  }

  identity(s: VmState): Parameters<typeof sendIdentity>[1] {
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
}
