import { chmod, mkdir } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import type { Readable } from 'node:stream';
import { type AgentEgressParsed, AppError, type EgressStatus, type HostCapacity } from '@fleet/agent-protocol';
import {
  type Backend,
  type Checkpoint,
  type CheckpointOptions,
  type CreateSpec,
  type DestroyOptions,
  invalidSpec,
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
import { runTool } from '../process/exec-util.js';
import { Firewall } from '../process/firewall.js';
import { parseSubnet } from '../process/network.js';
import { type Accel, type AccelReport, chooseAccel } from './accel.js';
import { CheckpointStore } from '../process/checkpoints.js';
import { type QemuBackendOptions, unsupportedByQemu, type VmState } from './vm-state.js';
import { createVm } from './vm-create.js';
import { reassertNetwork } from './vm-network.js';
import { destroyVm, stopVm } from './vm-teardown.js';
import { readGuestFile, spawnInVm, writeGuestFile } from './guest-io.js';
import { checkpointVm, pauseVm, restoreVmCheckpoint, resumeVm, vmLayerUsage } from './vm-memory.js';
import { abortIncoming, completeIncoming, memoryStatus, migrationOffer, prepareIncoming, sendMigration } from './vm-migration.js';
import { pruneVms, recoverVms } from './vm-recovery.js';
import { QemuHost } from './vm-host.js';
import { gpuCapacity, probeHostGpus } from './gpu-probe.js';

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

export { unsupportedByQemu, type QemuBackendOptions } from './vm-state.js';

export class QemuBackend implements Backend {
  readonly kind = 'qemu' as const;
  readonly accel: AccelReport;
  /** The GPU probe's last reasons for leaving devices out, logged when they change. */
  private saidSkipped = '[]';

  private constructor(private readonly host: QemuHost) {
    this.accel = host.accel;
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
    const backend = new QemuBackend(new QemuHost(opts, subnet, firewall, accel, options.logger, store, version));
    await backend.recover();
    return backend;
  }

  // ---- capacity ----

  async capacity(): Promise<HostCapacity & { accel: Accel; nested_virt_supported: boolean }> {
    // What nvidia-smi sees is on the host's driver, not passable: the offer is what sysfs says is bound to VFIO (gpu-probe.ts).
    const { capacity } = withoutDevices(
      await probeCapacity({ dataDir: this.host.opts.dataDir, maxSandboxes: this.host.opts.maxSandboxes }),
    );
    const gpus = await probeHostGpus(this.host.opts);
    const said = JSON.stringify(gpus.skipped);
    if (gpus.skipped.length > 0 && said !== this.saidSkipped) {
      this.host.log?.warn({ not_offered: gpus.skipped }, 'devices on VFIO or mdev that this host does not offer');
    }
    this.saidSkipped = said;
    return {
      ...capacity,
      ...gpuCapacity(gpus),
      accel: this.host.accel.accel,
      nested_virt_supported: this.host.accel.nestedVirtSupported,
      // QEMU writes and loads its own state: no host tool needed. No dirty-page diffs; post-copy (lazy) where userfaultfd exists.
      live_snapshot: true,
      lazy_pages: this.host.lazyPages,
      memory_diff: false,
    };
  }

  /** backend.go.txt NestedVirtSupported. */
  nestedVirtSupported(): boolean {
    return this.host.accel.nestedVirtSupported;
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
    await this.host.get(name);
    return { mode: 'none' };
  }

  create(input: CreateSpec): Promise<SandboxInfo> {
    return createVm(this.host, input);
  }

  // ---- read ----

  get(name: string): Promise<SandboxInfo> {
    return this.host.get(name);
  }

  list(prefix = ''): Promise<SandboxInfo[]> {
    return this.host.list(prefix);
  }

  // ---- processes and files (guest-io.ts) ----

  spawn(name: string, opts: SpawnOptions): Promise<ProcessHandle> {
    return spawnInVm(this.host, name, opts);
  }

  resolveGuestPath(): Promise<string> {
    return Promise.reject(unsupportedByQemu('host paths into a VM (use writeGuestFile/readGuestFile)'));
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

  // ---- destroy / stop (vm-teardown.ts) ----

  destroy(name: string, opts: DestroyOptions = {}): Promise<void> {
    return destroyVm(this.host, name, opts);
  }

  /**
   * backend.go.txt Stop: ACPI power button (the guest's acpid powers off), then
   * SIGKILL once `graceMs` has passed. Resolves when QEMU is gone.
   */
  stopVm(s: VmState, graceMs: number): Promise<'acpi' | 'killed' | 'gone'> {
    return stopVm(this.host, s, graceMs);
  }

  // ---- recovery, prune, network (vm-recovery.ts, vm-network.ts) ----

  /** Rediscovers VMs from their state files; a QEMU still running keeps its VM, and its endpoints are published again. */
  recover(): Promise<SandboxInfo[]> {
    return recoverVms(this.host);
  }

  prune(): Promise<PruneReport> {
    return pruneVms(this.host);
  }

  reassertNetwork(): Promise<NetworkReassertReport> {
    return reassertNetwork(this.host);
  }

  async close(): Promise<void> {
    this.host.closed = true;
    for (const r of this.host.records.values()) {
      for (const p of r.proxies.splice(0)) await p.close().catch(() => undefined);
      await r.console?.close().catch(() => undefined);
      r.console = undefined;
    }
  }

  // ---- memory state (vm-memory.ts) ----

  checkpoint(name: string, opts: CheckpointOptions): Promise<Checkpoint> {
    return checkpointVm(this.host, name, opts);
  }

  pause(name: string, opts: { id?: string; comment?: string } = {}): Promise<Checkpoint> {
    return pauseVm(this.host, name, opts);
  }

  resume(name: string): Promise<SandboxInfo> {
    return resumeVm(this.host, name);
  }

  restoreCheckpoint(name: string, checkpointId: string): Promise<SandboxInfo> {
    return restoreVmCheckpoint(this.host, name, checkpointId);
  }

  // ---- native live migration (vm-migration.ts) ----

  migrationOffer(name: string): Promise<Record<string, unknown>> {
    return migrationOffer(this.host, name);
  }

  prepareIncoming(input: CreateSpec, machine: Record<string, unknown>, opts: { ttlMs: number; lazy?: boolean }): Promise<MigrationTarget> {
    return prepareIncoming(this.host, input, machine, opts);
  }

  sendMigration(name: string, to: { uri: string; psk: string }, opts: { lazy?: boolean } = {}): Promise<MigrationSendReport> {
    return sendMigration(this.host, name, to, opts);
  }

  completeIncoming(name: string, opts: { keepPaused: boolean }): Promise<SandboxInfo> {
    return completeIncoming(this.host, name, opts);
  }

  abortIncoming(name: string): Promise<boolean> {
    return abortIncoming(this.host, name);
  }
  readonly memoryStatus = (name: string): ReturnType<typeof memoryStatus> => memoryStatus(this.host, name);

  // ---- checkpoints on disk ----

  layerUsage(name: string): Promise<LayerUsageReport> {
    return vmLayerUsage(this.host, name);
  }
  listCheckpoints(): Promise<Checkpoint[]> {
    return this.host.store.list();
  }
  getCheckpoint(id: string): Promise<Checkpoint> {
    return this.host.store.get(id);
  }
  deleteCheckpoint(id: string): Promise<void> {
    return this.host.store.delete(id);
  }
  async checkpointDir(id: string): Promise<string> {
    await this.host.store.get(id);
    return this.host.store.path(id);
  }
  stagingDir(): string {
    return this.host.store.staging;
  }
  importCheckpoint(stagingPath: string, opts: { verifyDigest?: boolean } = {}): Promise<Checkpoint> {
    return this.host.store.import(stagingPath, opts);
  }
}
