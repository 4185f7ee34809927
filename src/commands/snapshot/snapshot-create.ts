import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { AppError, ConflictError } from '@fleet/agent-protocol';
import type { QuotaPool } from '../../domain/tenant/tenant.decider.js';
import { validationErrorFromZod } from '../../domain/vm/spec.js';
import type { HostCommands } from '../host/host-commands.js';
import { sandboxName, type Actor, type VmCommands } from '../vm/vm-commands.js';
import type { SnapshotQuota } from './snapshot-quota.js';
import { createSnapshotRequestSchema } from './snapshot-request.js';
import type { SnapshotStream } from './snapshot-stream.js';
import type { SnapshotConfig, SnapshotReads, SnapshotResult } from './snapshot-types.js';

/**
 * Takes a snapshot of a running VM: quota reserved before anything is
 * archived, the agent's checkpoint, the real size charged, the snapshot
 * completed (or failed, with its quota and refused archive released).
 */
export class SnapshotCreate {
  constructor(
    private readonly stream: SnapshotStream,
    private readonly quota: SnapshotQuota,
    private readonly hosts: HostCommands,
    private readonly vms: VmCommands,
    private readonly reads: SnapshotReads,
    private readonly config: SnapshotConfig,
    private readonly logger: Logger,
  ) {}

  async create(vmId: string, input: unknown, actor: Actor, now = new Date()): Promise<SnapshotResult> {
    const parsed = createSnapshotRequestSchema.safeParse(input ?? {});
    if (!parsed.success) throw validationErrorFromZod(parsed.error, 'snapshot request');
    const req = parsed.data;
    const vm = await this.vms.get(vmId, actor);
    if (vm.status !== 'running' || !vm.host_id) {
      throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: only a running VM can be snapshotted`, {
        vm_id: vmId,
        status: vm.status,
      });
    }
    const hostId = vm.host_id;
    const { state: host } = await this.hosts.load(hostId);
    const arch = host.status === 'unregistered' ? '' : (host.capacity.arch ?? '');
    // A diff needs the host to track which memory pages changed; never a silent full snapshot in its place.
    if (req.diff && (host.status === 'unregistered' || host.capacity.memory_diff !== true)) {
      throw new ConflictError(
        'MEMORY_DIFF_UNSUPPORTED',
        `host ${hostId} cannot track memory changes (no soft-dirty bits in its kernel), so it cannot take a diff snapshot; ask for a full live snapshot (live: true without diff)`,
        { vm_id: vmId, host_id: hostId },
      );
    }
    const snapshotId = `snap-${randomBytes(10).toString('hex')}`;
    // A layer is filed under the caller's tenant (from its key) so a later build of the same tenant can hit;
    // every other snapshot belongs to its VM's tenant.
    const tenantId = req.layer_key !== undefined ? actor.tenantId : vm.tenant_id;
    const counted = req.mode !== 'build';
    const retentionUntil =
      req.retention_until ??
      (req.retention_s !== undefined
        ? new Date(now.getTime() + req.retention_s * 1000).toISOString()
        : this.config.defaultRetentionMs > 0
          ? new Date(now.getTime() + this.config.defaultRetentionMs).toISOString()
          : undefined);
    // A layer is found by its key, not by a VM's history: it takes no lineage link (which would pin its predecessor).
    const parent = req.no_lineage || req.layer_key !== undefined ? undefined : (await this.reads.latestReadyOfVm(vmId))?.id;
    const metadata: Record<string, string> = { ...req.metadata, comment: req.comment, vm_id: vmId, mode: req.mode, host_id: hostId, arch };
    if (req.layer_key !== undefined) metadata.layer_key = req.layer_key;

    const pool: QuotaPool = counted ? 'snapshots' : 'builds';
    const limits = counted ? this.config.quota : this.config.buildQuota;
    const name = sandboxName(vmId);
    // Bytes are checked BEFORE anything is archived: the agent tells what a checkpoint of the layer is expected to take.
    const expected = limits.max_bytes > 0 ? (await (await this.hosts.agentFor(hostId)).layerUsage(name)).expected_archive_bytes : 0;
    const maxBytes = await this.quota.reserve(tenantId, snapshotId, actor, pool, limits, expected);
    try {
      await this.stream.run(
        snapshotId,
        {
          type: 'RequestSnapshot',
          data: {
            snapshot_id: snapshotId,
            vm_id: vmId,
            tenant_id: tenantId,
            task_id: vm.task_id,
            host_id: hostId,
            arch,
            mode: req.mode,
            comment: req.comment,
            metadata,
            retention_until: retentionUntil,
            parent_snapshot_id: parent,
            layer_key: req.layer_key,
            ask: { live: req.live, diff: req.diff, keep_paused: req.keep_paused, shrink: req.shrink },
            quota_counted: counted,
          },
        },
        actor,
      );
    } catch (err) {
      await this.quota.release(tenantId, snapshotId, actor);
      throw err;
    }
    let archived = false;
    try {
      const agent = await this.hosts.agentFor(hostId);
      // The protocol carries `live` only; diff/keep_paused/shrink are recorded as asked, and the kind is what came back.
      // max_bytes: the agent abandons an archive that outgrows the quota's headroom (the guest wrote on after the estimate).
      const cp = await agent.checkpoint(
        name,
        { id: snapshotId, comment: req.comment, live: req.live, ...(maxBytes ? { max_bytes: maxBytes } : {}) },
        { timeoutMs: this.config.checkpointTimeoutMs },
      );
      archived = true;
      // The real size replaces the estimate, and is refused if siblings took the room meanwhile: never over quota.
      await this.quota.size(tenantId, snapshotId, cp.size_bytes, limits, actor);
      const done = await this.stream.run(
        snapshotId,
        {
          type: 'CompleteSnapshot',
          data: {
            snapshot_id: snapshotId,
            digest: cp.digest,
            size_bytes: cp.size_bytes,
            kind: cp.kind,
            files: cp.files,
            ...(cp.pause_ms !== undefined ? { pause_ms: cp.pause_ms } : {}),
          },
        },
        actor,
      );
      let last = done;
      for (const e of req.exports)
        last = await this.stream.run(
          snapshotId,
          { type: 'RequestExport', data: { snapshot_id: snapshotId, destination: e.destination } },
          actor,
        );
      return last;
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      this.logger.warn(
        { snapshot_id: snapshotId, vm_id: vmId, code: e?.code, err: { message: (err as Error).message } },
        'snapshot failed',
      );
      await this.stream
        .run(
          snapshotId,
          { type: 'FailSnapshot', data: { snapshot_id: snapshotId, error: (err as Error).message, error_code: e?.code } },
          actor,
        )
        .catch(() => undefined);
      await this.quota.release(tenantId, snapshotId, actor).catch(() => undefined);
      if (archived) {
        const agent = await this.hosts.agentFor(hostId).catch(() => undefined);
        await agent
          ?.deleteCheckpoint(snapshotId)
          .catch((de: unknown) =>
            this.logger.warn(
              { snapshot_id: snapshotId, err: { message: (de as Error).message } },
              'refused archive not deleted on its host',
            ),
          );
      }
      if (e?.code === 'CHECKPOINT_TOO_LARGE') {
        throw await this.quota.exceeded(tenantId, limits, pool);
      }
      throw err;
    }
  }
}
