import type { z } from 'zod';
import {
  type PauseVmRequest,
  type RestoreVmRequest,
  type ArtifactMove,
  type ArtifactMoved,
  type Checkpoint,
  type CreateCheckpointRequest,
  type LayerUsageResponse,
  type GrantResponse,
  type VmInfo,
  artifactMovedSchema,
  checkpointSchema,
  pauseVmResponseSchema,
  deleteCheckpointResponseSchema,
  grantResponseSchema,
  layerUsageResponseSchema,
  listCheckpointsResponseSchema,
  vmInfoSchema,
} from '@fleet/agent-protocol';
import { type CallOptions } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

/** Checkpoints and memory: checkpoint, layers, artifacts, pause/resume/restore. */
export class CheckpointRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  checkpoint(name: string, req: CreateCheckpointRequest, opts?: CallOptions): Promise<Checkpoint> {
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/checkpoints`,
      json: req,
      schema: checkpointSchema,
      idempotent: false,
      opts,
    });
  }

  layerUsage(name: string, opts?: CallOptions): Promise<LayerUsageResponse> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}/layer-usage`, schema: layerUsageResponseSchema, idempotent: true, opts });
  }

  async listCheckpoints(opts?: CallOptions): Promise<Checkpoint[]> {
    const res = await this.#call({ method: 'GET', path: '/checkpoints', schema: listCheckpointsResponseSchema, idempotent: true, opts });
    return res.checkpoints;
  }

  deleteCheckpoint(id: string, opts?: CallOptions): Promise<{ id: string; deleted: boolean }> {
    return this.#call({
      method: 'DELETE',
      path: `/checkpoints/${seg(id)}`,
      schema: deleteCheckpointResponseSchema,
      idempotent: true,
      opts,
    });
  }

  grantArtifact(snapshotId: string, ttlSeconds?: number, opts?: CallOptions): Promise<GrantResponse> {
    return this.#call({
      method: 'POST',
      path: '/artifacts/grants',
      json: { snapshot_id: snapshotId, ttl_s: ttlSeconds },
      schema: grantResponseSchema,
      idempotent: false,
      opts,
    });
  }

  pullArtifact(move: ArtifactMove, opts?: CallOptions): Promise<ArtifactMoved> {
    // A pull moves gigabytes: its bound is the caller's, defaulting to 30 minutes, not the short per-call default.
    const callOpts: CallOptions = { ...opts, timeoutMs: opts?.timeoutMs ?? 30 * 60_000 };
    return this.#call({
      method: 'POST',
      path: '/artifacts/pull',
      json: move,
      schema: artifactMovedSchema,
      idempotent: false,
      opts: callOpts,
    });
  }

  pauseVm(name: string, req: PauseVmRequest = {}, opts?: CallOptions): Promise<{ vm: VmInfo; checkpoint: Checkpoint }> {
    // A second pause answers the first's checkpoint: safe to retry.
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/pause`,
      json: req,
      schema: pauseVmResponseSchema,
      idempotent: true,
      opts,
    });
  }

  resumeVm(name: string, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'POST', path: `/vms/${seg(name)}/resume`, json: {}, schema: vmInfoSchema, idempotent: true, opts });
  }

  restoreVm(name: string, req: RestoreVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'POST', path: `/vms/${seg(name)}/restore`, json: req, schema: vmInfoSchema, idempotent: false, opts });
  }
}
