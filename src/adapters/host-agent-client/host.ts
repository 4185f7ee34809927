import type { z } from 'zod';
import {
  type CapacityResponse,
  type NetworkReassertResponse,
  type PruneResponse,
  capacityResponseSchema,
  networkReassertResponseSchema,
  pruneResponseSchema,
} from '@fleet/agent-protocol';
import { type CallOptions } from '../../domain/host-agent.port.js';
import { type AgentTransport, type RequestSpec } from './transport.js';

/** The host itself: capacity, prune, network reassert. */
export class HostRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  capacity(opts?: CallOptions): Promise<CapacityResponse> {
    return this.#call({ method: 'GET', path: '/capacity', schema: capacityResponseSchema, idempotent: true, opts });
  }

  prune(opts?: CallOptions): Promise<PruneResponse> {
    return this.#call({ method: 'POST', path: '/prune', schema: pruneResponseSchema, idempotent: true, opts });
  }

  reassertNetwork(opts?: CallOptions): Promise<NetworkReassertResponse> {
    return this.#call({ method: 'POST', path: '/network/reassert', schema: networkReassertResponseSchema, idempotent: true, opts });
  }
}
