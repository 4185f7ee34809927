import { randomBytes } from 'node:crypto';
import { readFile, rename, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { Logger } from 'pino';
import { AppError } from '@fleet/agent-protocol';
import { sandboxNotFound, sandboxNotRunning, type Endpoint, type SandboxInfo } from '../../backend.js';
import type { Cgroups } from './cgroups.js';
import { CheckpointStore } from './checkpoints.js';
import type { CriuFeatures } from './criu.js';
import type { LazyDaemon } from './criu-lazy.js';
import { DiskPool } from './disk-pool.js';
import { EgressHost, forwards, usesAgentProxy } from './egress-host.js';
import type { SandboxEgress } from './egress.js';
import { KeyedMutex, processStartTime } from './exec-util.js';
import type { Firewall, FirewallState } from './firewall.js';
import type { Spawner } from './guest-process.js';
import { emptyDirOf, ensureEmptyDir } from '../../native/helper.js';
import { launchInit, USERNS_SIZE, type HostTools } from './launch.js';
import { SandboxMonitor } from './monitor.js';
import { attachSandbox, bridgeForwarding, ensureBridge, hardenLink, type Subnet } from './network.js';
import type { ProcessOptions } from './options.js';
import { startProxy, type Proxy } from './proxy.js';
import { persistedSchema, type Persisted, type SandboxRecord } from './sandbox-state.js';
import { layerDirs } from './storage.js';

/**
 * What every part of the process backend shares: the host's tools, cgroups,
 * firewall and subnet, the sandboxes this agent holds (records) and the
 * small steps several paths take on one (persist, publish, launch, info).
 * The jobs themselves are functions over it in the sibling modules.
 */
export class SandboxHost {
  readonly records = new Map<string, SandboxRecord>();
  readonly locks = new KeyedMutex();
  readonly bridgesReady = new Set<string>();
  readonly checkpoints: CheckpointStore;
  readonly sandboxesDir: string;
  closed = false;
  spawner: Spawner | null = null;
  /** Metrics, OOM kills and kept console logs (monitor.ts). */
  readonly observer: SandboxMonitor;
  readonly egress: EgressHost;
  criu: CriuFeatures | null = null;
  /** CRIU's action script at a restore: the helper (fleet-sandbox.c `cmd_criu_hook`); a test may wrap it. */
  criuHook = '';
  /**
   * How long one `criu restore` may take before it is killed and tried once more (criu-sandbox.ts): a restore takes
   * 0.3-2.5 s here, loaded or not; two tries and the set-up fit in the control plane's 20 s agent call.
   */
  restoreDeadlineMs = 7_000;
  /**
   * Restores that page memory in after they run (the backend's LazyMemory): told of one from this host's own images
   * (criu-sandbox.ts), and asked by every memory capture, under the sandbox's lock, before it freezes the guest.
   */
  paging: { track(name: string, daemon: LazyDaemon): void; awaitResident(name: string): Promise<void>; forget(name: string): void } = {
    track: () => undefined,
    awaitResident: () => Promise.resolve(),
    forget: () => undefined,
  };
  /** Staging entries a dump or restore is using now: prune leaves them. */
  readonly scratch = new Set<string>();
  /** Disks formatted ahead of creates (disk-pool.ts). */
  readonly disks: DiskPool;

  constructor(
    readonly opts: ProcessOptions,
    readonly subnet: Subnet,
    readonly cgroups: Cgroups,
    readonly tools: HostTools,
    readonly firewall: Firewall,
    readonly log: Logger | undefined,
  ) {
    this.sandboxesDir = join(opts.dataDir, 'sandboxes');
    this.checkpoints = new CheckpointStore(join(opts.dataDir, 'checkpoints'), join(opts.dataDir, 'staging'));
    this.disks = new DiskPool(
      opts.dataDir,
      opts.diskPool,
      opts.diskPoolGb,
      () => [...this.records.values()].some((r) => r.state.status === 'creating'),
      log,
    );
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

  sandboxDir(name: string): string {
    return join(this.sandboxesDir, name);
  }

  /** The sandbox's own empty directory, bound over its masked /proc and /sys directories (helper.ts). */
  emptyDir(name: string): string {
    return emptyDirOf(this.tools.emptyRoot, this.sandboxDir(name));
  }

  async list(prefix = ''): Promise<SandboxInfo[]> {
    const out: SandboxInfo[] = [];
    for (const r of this.records.values()) {
      if (r.state.status !== 'creating' && r.state.name.startsWith(prefix)) out.push(await this.info(r));
    }
    return out.sort((a, b) => a.name.localeCompare(b.name));
  }

  requireCriu(): CriuFeatures {
    if (!this.criu) {
      throw new AppError(
        'MEMORY_CHECKPOINT_UNSUPPORTED',
        409,
        'this host cannot checkpoint memory (no working criu: set CRIU_PATH or install criu >= 4.0)',
      );
    }
    return this.criu;
  }

  async readyBridge(record: SandboxRecord): Promise<void> {
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
  async launch(record: SandboxRecord, imagePath: string, mark?: (phase: string) => void): Promise<void> {
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
      emptyDir: await ensureEmptyDir(this.emptyDir(state.name)),
      ...(mark ? { mark } : {}),
      attachNetwork: (nsPid) =>
        attachSandbox({ bridge: state.bridge, veth: state.veth, nsPid, ip: state.ip, mac: state.mac, subnet: this.subnet }),
    });
    state.init_pid = launched.initPid;
    state.init_start = launched.initStart;
  }

  firewallState(): FirewallState {
    const states = [...this.records.values()].map((r) => r.state);
    return {
      bridges: [...new Set(states.map((s) => s.bridge))],
      ports: states.map((s) => ({ veth: s.veth, mac: s.mac, ip: s.ip })),
      egress: { cfg: this.egress.cfg, ports: states.map((s) => ({ ip: s.ip, veth: s.veth, bridge: s.bridge, egress: s.egress })) },
    };
  }

  /** A bridge forwards (IPv4, per interface) only while a sandbox on it may leave it; the nftables rules stay the boundary. */
  forwardingOf(bridge: string): '0' | '1' {
    return [...this.records.values()].some((r) => r.state.bridge === bridge && forwards(r.state.egress)) ? '1' : '0';
  }

  async syncBridgeForwarding(bridge: string): Promise<void> {
    await hardenLink(bridge, 'bridge', this.forwardingOf(bridge));
  }

  proxyPolicyOf(ip: string): SandboxEgress | undefined {
    for (const r of this.records.values()) if (r.state.ip === ip && usesAgentProxy(r.state.egress)) return r.state.egress;
    return undefined;
  }

  /**
   * A block no live sandbox of this agent uses. Random rather than the
   * lowest free one, so two agents on one host (distinct data directories)
   * are unlikely to hand out the same block; sharing one would still leave
   * the sandboxes apart (no shared files, pids or IPC), only less so.
   */
  pickUidBase(): number {
    const used = new Set([...this.records.values()].map((r) => r.state.uid_base));
    const first = this.opts.uidBase / USERNS_SIZE;
    const blocks = 2 ** 32 / USERNS_SIZE - 1 - first;
    for (;;) {
      const base = (first + (randomBytes(4).readUInt32BE() % blocks)) * USERNS_SIZE;
      if (!used.has(base)) return base;
    }
  }

  assertOpen(): void {
    if (this.closed) throw new AppError('BACKEND_CLOSED', 503, 'the backend is shutting down');
  }

  must(name: string): SandboxRecord {
    const r = this.records.get(name);
    if (!r || r.state.status !== 'running') throw sandboxNotFound(name);
    return r;
  }

  async isAlive(state: Persisted): Promise<boolean> {
    if (!state.init_pid) return false;
    return (await processStartTime(state.init_pid)) === state.init_start;
  }

  async assertRunning(record: SandboxRecord): Promise<void> {
    if (!(await this.isAlive(record.state))) throw sandboxNotRunning(record.state.name);
  }

  async info(record: SandboxRecord): Promise<SandboxInfo> {
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

  endpoints(record: SandboxRecord): Endpoint[] {
    const host = this.opts.advertiseHost ?? (this.opts.publishHost === '0.0.0.0' ? '127.0.0.1' : this.opts.publishHost);
    return record.state.expose.flatMap((e, i) => {
      const proxy = record.proxies[i];
      if (!proxy) return [];
      const protocol = e.protocol ?? 'tcp';
      const scheme = protocol === 'udp' ? 'udp' : /http/i.test(e.as) ? 'http' : 'tcp';
      return [{ as: e.as, url: `${scheme}://${host}:${proxy.hostPort}`, port: e.port, protocol, host_port: proxy.hostPort }];
    });
  }

  async publish(record: SandboxRecord): Promise<void> {
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

  async unpublish(record: SandboxRecord): Promise<void> {
    const proxies = record.proxies.splice(0);
    await Promise.all(proxies.map((p) => p.close().catch(() => undefined)));
  }

  async persist(state: Persisted): Promise<void> {
    const file = join(this.sandboxDir(state.name), 'state.json');
    await writeFile(`${file}.tmp`, JSON.stringify(state, null, 2), { mode: 0o600 });
    await rename(`${file}.tmp`, file);
  }

  async readState(name: string): Promise<Persisted | null> {
    try {
      const parsed = persistedSchema.safeParse(JSON.parse(await readFile(join(this.sandboxDir(name), 'state.json'), 'utf8')));
      return parsed.success && parsed.data.name === name ? parsed.data : null;
    } catch {
      return null;
    }
  }
}
