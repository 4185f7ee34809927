import { z } from 'zod';
import { type Checkpoint, type PauseVmRequest, type VmInfo, pauseVmResponseSchema, vmInfoSchema } from '@fleet/agent-protocol';
import { type CallOptions, type LazyCreateVmRequest, type MemoryStatus } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

const memoryStatusSchema = z.object({
  resident_chunks: z.number().int().nonnegative(),
  total_chunks: z.number().int().nonnegative(),
  done: z.boolean(),
  error: z.string().optional(),
});
const pagesSchema = z.object({ checkpoint_id: z.string(), pinned: z.boolean(), streaming: z.boolean() });
const releasedSchema = z.object({ checkpoint_id: z.string(), released: z.boolean() });

/** Lazy (post-copy) moves: the agent's lazy routes (packages/agent/src/routes/lazy.routes.ts). */
export class LazyRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  lazyPauseVm(name: string, req: PauseVmRequest = {}, opts?: CallOptions): Promise<{ vm: VmInfo; checkpoint: Checkpoint }> {
    // A second lazy pause of a pinned capture answers that capture: safe to retry.
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/lazy-pause`,
      json: req,
      schema: pauseVmResponseSchema,
      idempotent: true,
      opts,
    });
  }

  createLazyVm(req: LazyCreateVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'POST', path: '/vms/lazy', json: req, schema: vmInfoSchema, idempotent: false, opts });
  }

  memoryStatus(name: string, opts?: CallOptions): Promise<MemoryStatus> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}/memory`, schema: memoryStatusSchema, idempotent: true, opts });
  }

  lazyPages(checkpointId: string, opts?: CallOptions): Promise<{ pinned: boolean; streaming: boolean }> {
    return this.#call({ method: 'GET', path: `/checkpoints/${seg(checkpointId)}/pages`, schema: pagesSchema, idempotent: true, opts });
  }

  releaseLazyPages(checkpointId: string, opts?: CallOptions): Promise<{ released: boolean }> {
    return this.#call({
      method: 'DELETE',
      path: `/checkpoints/${seg(checkpointId)}/pages`,
      schema: releasedSchema,
      idempotent: true,
      opts,
    });
  }
}
