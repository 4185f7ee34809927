import { chmod, mkdir, rm } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import type { Readable } from 'node:stream';
import { describeFields, fieldsFromZod } from '@fleet/agent-protocol';
import type { HostCapacity } from '@fleet/agent-protocol';
import {
  gpuBindingRefusal,
  invalidSpec,
  type Backend,
  type Checkpoint,
  type CheckpointOptions,
  type CreateSpec,
  type DestroyOptions,
  type NetworkReassertReport,
  type ProcessHandle,
  type PruneReport,
  type SandboxInfo,
  type SpawnOptions,
} from '../../backend.js';
import { ensureSandboxHelper } from '../../native/helper.js';
import { probeCapacity, withoutDevices } from '../host-capacity.js';
import { nameRe } from '../spec-rules.js';
import { Cgroups } from './cgroups.js';
import { expectedArchiveBytes } from './checkpoints.js';
import { detectCriu } from './criu.js';
import type { SandboxEgress } from './egress.js';
import { Firewall } from './firewall.js';
import { enterSandbox, spawnInSandbox } from './guest-exec.js';
import { readGuestFile, resolveGuestPath, writeGuestFile } from './guest-files.js';
import { Spawner } from './guest-process.js';
import { findHostTools, type EnterOp, type HostTools } from './launch.js';
import { parseSubnet } from './network.js';
import { assertHostFeatures, optionsSchema, type ProcessBackendOptions } from './options.js';
import { LazyMemory } from './criu-lazy-sandbox.js';
import { createSandbox } from './sandbox-create.js';
import { SandboxHost } from './sandbox-host.js';
import { checkpointSandbox, pauseSandbox, restoreSandboxCheckpoint, resumeSandbox } from './sandbox-memory.js';
import { egressStatus, reassertNetwork, setEgress } from './sandbox-network.js';
import { pruneHost, recoverSandboxes } from './sandbox-recovery.js';
import type { SandboxRecord } from './sandbox-state.js';
import { teardownSandbox } from './sandbox-teardown.js';
import type { DiskPoolStatus } from './disk-pool.js';
import { layerUsage, requireDiskTools, type LayerUsage } from './storage.js';

export { optionsSchema, type ProcessBackendOptions } from './options.js';

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
export class ProcessBackend implements Backend {
  readonly kind = 'process' as const;
  private saidLeftOut = false;
  /** Metrics, OOM kills and kept console logs (monitor.ts). */
  readonly observer: SandboxHost['observer'];
  /** Lazy (post-copy) moves: criu-lazy-sandbox.ts. */
  readonly lazy: LazyMemory;

  private constructor(private readonly host: SandboxHost) {
    this.observer = host.observer;
    this.lazy = new LazyMemory(host);
    host.paging = this.lazy;
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
    const tools: HostTools = { ...findHostTools(opts.busybox), ...(await ensureSandboxHelper(opts.dataDir)) };
    const cgroups = Cgroups.detect(`fleet-${opts.bridgePrefix}`, opts.cgroupRoot);
    await cgroups.verify();
    await mkdir(opts.dataDir, { recursive: true, mode: 0o700 });
    // Closed to host users whatever the data dir's mode: a layer holds files owned by on-disk id 0 (sandbox root),
    // set-uid ones included when the sandbox has no disk of its own (no nosuid mount under them).
    await mkdir(join(opts.dataDir, 'sandboxes'), { recursive: true, mode: 0o700 });
    await chmod(join(opts.dataDir, 'sandboxes'), 0o700);
    await mkdir(opts.imageDir, { recursive: true });
    const firewall = await Firewall.open(opts.bridgePrefix);
    firewall.onRepairs = (repairs) => logger?.warn({ repairs }, 'sandbox firewall changed behind the agent: put back');
    const host = new SandboxHost(opts, subnet, cgroups, tools, firewall, logger);
    const backend = new ProcessBackend(host);
    await host.checkpoints.init();
    const found = await detectCriu(undefined, opts.lazyRestore);
    host.criu = found.features;
    if (found.features) {
      host.criuHook = tools.helper;
      logger?.info(
        { criu: found.features.path, version: found.features.version, notes: found.features.notes },
        'criu found: memory checkpoints on',
      );
    } else logger?.info({ reason: found.reason }, 'no usable criu: checkpoints are disk only');
    await backend.recover();
    // Before anything may capture a sandbox's memory: a restore the last run left paging in is waited for again.
    if (found.features) await backend.lazy.adoptOrphans();
    await host.disks.start();
    host.spawner = await Spawner.start(tools.helper, join(opts.dataDir, 'exec.sock'), (err) => logger?.warn({ err }, 'exec spawner')).catch(
      (err: unknown) => {
        logger?.warn({ err }, 'the exec spawner did not start: every exec spawns the helper');
        return null;
      },
    );
    backend.observer.start();
    return backend;
  }

  get cgroupVersion(): 1 | 2 {
    return this.host.cgroups.version;
  }

  /** Kernel-reported limits of a sandbox's cgroup (diagnostics and tests). */
  async cgroupLimits(name: string): ReturnType<Cgroups['readLimits']> {
    this.host.must(name);
    return this.host.cgroups.readLimits(name);
  }

  sandboxDir(name: string): string {
    return this.host.sandboxDir(name);
  }

  async capacity(): Promise<HostCapacity> {
    const { capacity: cap, leftOut } = withoutDevices(
      await probeCapacity({ dataDir: this.host.opts.dataDir, maxSandboxes: this.host.opts.maxSandboxes }),
    );
    if (leftOut.length > 0 && !this.saidLeftOut) {
      this.saidLeftOut = true;
      this.host.log?.warn(
        { left_out: leftOut },
        `this host has ${leftOut.join(' and ')}: the process backend cannot pass devices through, so they are not offered (a qemu host can)`,
      );
    }
    // Sandbox disks are preallocated, so free space already lacks them, and placement subtracts each VM's storage_gb
    // again: a probe while sandboxes run must not count them twice. A paused sandbox has no reservation: its disk stays
    // counted here, as used space.
    const held = [...this.host.records.values()].filter((r) => r.state.status !== 'paused').reduce((n, r) => n + r.state.storage_gb, 0);
    return {
      ...cap,
      // The pool's ready disks are preallocated too, and the next creates get them.
      storage_gb: cap.storage_gb + held + this.host.disks.heldGb(),
      live_snapshot: this.host.criu?.liveSnapshot ?? false,
      lazy_pages: this.host.criu?.lazyPages ?? false,
      memory_diff: this.host.criu?.memoryDiff ?? false,
    };
  }

  create(input: CreateSpec): Promise<SandboxInfo> {
    // A namespace sandbox cannot take a PCI device: refused, never created without the GPUs it was bound to.
    const refused = gpuBindingRefusal(input, 'process');
    if (refused) return Promise.reject(refused);
    return createSandbox(this.host, input);
  }

  async get(name: string): Promise<SandboxInfo> {
    const r = this.host.records.get(name);
    // A paused sandbox exists (its disk, its checkpoint): it can be read and destroyed, not entered.
    if (r?.state.status === 'paused') return this.host.info(r);
    return this.host.info(this.host.must(name));
  }

  list(prefix = ''): Promise<SandboxInfo[]> {
    return this.host.list(prefix);
  }

  async destroy(name: string, opts: DestroyOptions = {}): Promise<void> {
    this.lazy.forget(name);
    if (!nameRe.test(name)) return;
    await this.host.locks.run(`sb:${name}`, async () => {
      let record = this.host.records.get(name);
      if (!record) {
        const state = await this.host.readState(name);
        if (!state) {
          await rm(this.host.sandboxDir(name), { recursive: true, force: true });
          return;
        }
        record = { state, proxies: [] };
      }
      await teardownSandbox(this.host, record, opts);
      this.host.log?.info({ sandbox: name }, 'sandbox destroyed');
    });
  }

  spawn(name: string, opts: SpawnOptions): Promise<ProcessHandle> {
    return spawnInSandbox(this.host, name, opts);
  }

  resolveGuestPath(name: string, guestPath: string, opts: { forWrite: boolean }): Promise<string> {
    return resolveGuestPath(this.host, name, guestPath, opts);
  }

  writeGuestFile(
    name: string,
    guestPath: string,
    data: Readable,
    opts: { mode?: number; maxBytes?: number; parents?: boolean } = {},
  ): Promise<{ path: string; bytes: number }> {
    return writeGuestFile(this.host, name, guestPath, data, opts);
  }

  readGuestFile(name: string, guestPath: string): Promise<{ path: string; size: number; stream: Readable; done: Promise<void> }> {
    return readGuestFile(this.host, name, guestPath);
  }

  async checkpoint(name: string, opts: CheckpointOptions): Promise<Checkpoint> {
    return checkpointSandbox(this.host, name, opts);
  }

  /**
   * Takes a memory checkpoint and stops the sandbox: its processes are gone,
   * its CPU and memory free, its disk and layer kept (state `paused`) until
   * resume() or destroy(). The checkpoint is an ordinary live one: it can be
   * moved, and restored under another name elsewhere (create with resume).
   */
  async pause(name: string, opts: { id?: string; comment?: string } = {}): Promise<Checkpoint> {
    return pauseSandbox(this.host, name, opts);
  }

  /** Restores a paused sandbox from its pause checkpoint (idempotent: a running one is answered as it is). */
  resume(name: string): Promise<SandboxInfo> {
    return resumeSandbox(this.host, name);
  }

  /** Puts a sandbox (running or paused) back to a checkpoint (sandbox-memory.ts). */
  restoreCheckpoint(name: string, checkpointId: string): Promise<SandboxInfo> {
    return restoreSandboxCheckpoint(this.host, name, checkpointId);
  }

  /** What the writable layer holds now, and what archiving it is expected to take (checked against quotas before archiving). */
  async layerUsage(name: string): Promise<LayerUsage & { expected_archive_bytes: number }> {
    const record = this.host.must(name);
    const usage = await layerUsage(this.host.sandboxDir(name), record.state.storage_gb);
    return { ...usage, expected_archive_bytes: expectedArchiveBytes(usage) };
  }

  listCheckpoints(): Promise<Checkpoint[]> {
    return this.host.checkpoints.list();
  }

  getCheckpoint(id: string): Promise<Checkpoint> {
    return this.host.checkpoints.get(id);
  }

  deleteCheckpoint(id: string): Promise<void> {
    return this.host.checkpoints.delete(id);
  }

  async checkpointDir(id: string): Promise<string> {
    await this.host.checkpoints.get(id);
    return this.host.checkpoints.path(id);
  }

  stagingDir(): string {
    return this.host.checkpoints.staging;
  }

  importCheckpoint(stagingPath: string, opts: { verifyDigest?: boolean } = {}): Promise<Checkpoint> {
    return this.host.checkpoints.import(stagingPath, opts);
  }

  recover(): Promise<SandboxInfo[]> {
    return recoverSandboxes(this.host);
  }

  prune(): Promise<PruneReport> {
    return pruneHost(this.host);
  }

  /**
   * Puts the network boundary back where anything changed it: our nftables
   * tables (missing or edited), and each bridge's and veth's sysctls (a
   * write of net.ipv4.ip_forward turns every bridge's forwarding back on).
   */
  reassertNetwork(): Promise<NetworkReassertReport> {
    return reassertNetwork(this.host);
  }

  /** The bridge and host-side veth a sandbox is on (diagnostics and tests). */
  networkOf(name: string): { bridge: string; veth: string } {
    const { bridge, veth } = this.host.must(name).state;
    return { bridge, veth };
  }

  /** Replaces a running sandbox's outbound policy: firewall, bridge forwarding, the guest's proxy variables (later execs). */
  setEgress(name: string, egress: SandboxEgress): Promise<SandboxInfo> {
    return setEgress(this.host, name, egress);
  }

  /** The resolved policy with a probe of its proxy endpoint. */
  egressStatus(name: string): Promise<NonNullable<SandboxInfo['egress']>> {
    return egressStatus(this.host, name);
  }

  async close(): Promise<void> {
    this.lazy.close();
    this.host.closed = true;
    this.observer.stop();
    this.host.spawner?.close();
    for (const r of this.host.records.values()) await this.host.unpublish(r);
    await this.host.egress.close();
    await this.host.disks.close();
  }

  /** The disk pool's size and fill (diagnostics, tests, the tti bench). */
  diskPool(): DiskPoolStatus {
    return this.host.disks.status();
  }

  // Diagnostics and tests reach these (exec spawner, egress proxy, the helper's argv).
  private get spawner(): SandboxHost['spawner'] {
    return this.host.spawner;
  }

  private get egress(): SandboxHost['egress'] {
    return this.host.egress;
  }

  private enter(record: SandboxRecord, op: EnterOp, cwd = '/', winsize?: { rows: number; cols: number }): Promise<string[]> {
    return enterSandbox(this.host, record, op, cwd, winsize);
  }

  private must(name: string): SandboxRecord {
    return this.host.must(name);
  }
}
