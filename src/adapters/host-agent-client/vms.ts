import type { z } from 'zod';
import {
  type CreateVmRequest,
  type DestroyVmResponse,
  type VmInfo,
  destroyVmResponseSchema,
  listVmsResponseSchema,
  vmInfoSchema,
} from '@fleet/agent-protocol';
import { type CallOptions } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

/** Sandboxes: create, read, list, destroy (the agent's vms routes). */
export class VmRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  createVm(req: CreateVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'POST', path: '/vms', json: req, schema: vmInfoSchema, idempotent: false, opts });
  }

  getVm(name: string, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}`, schema: vmInfoSchema, idempotent: true, opts });
  }

  async listVms(prefix = '', opts?: CallOptions): Promise<VmInfo[]> {
    const res = await this.#call({ method: 'GET', path: '/vms', query: { prefix }, schema: listVmsResponseSchema, idempotent: true, opts });
    return res.vms;
  }

  destroyVm(name: string, opts?: CallOptions & { force?: boolean }): Promise<DestroyVmResponse> {
    return this.#call({
      method: 'DELETE',
      path: `/vms/${seg(name)}`,
      query: { force: opts?.force ? 'true' : undefined },
      schema: destroyVmResponseSchema,
      idempotent: true,
      opts,
    });
  }
}
