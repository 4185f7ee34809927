import type { z } from 'zod';
import { type VmInfo, type AgentEgress, type EgressStatus, egressStatusSchema, vmInfoSchema } from '@fleet/agent-protocol';
import { type CallOptions } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

/** A sandbox's egress policy. */
export class EgressRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  setEgress(name: string, egress: AgentEgress, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({ method: 'PUT', path: `/vms/${seg(name)}/egress`, json: egress, schema: vmInfoSchema, idempotent: true, opts });
  }

  egressStatus(name: string, opts?: CallOptions): Promise<EgressStatus> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}/egress`, schema: egressStatusSchema, idempotent: true, opts });
  }
}
