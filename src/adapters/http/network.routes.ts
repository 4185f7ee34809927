import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { egressSpecSchema, egressStatusSchema } from '@fleet/agent-protocol';
import type { VmCommands } from '../../commands/vm/vm-commands.js';
import { problemResponses } from './common.js';
import { actorOf, fromState, vmSchema } from './vms.routes.js';

export interface NetworkRoutesDeps {
  readonly vms: VmCommands;
}

/** A VM's network policy: read it resolved (with its proxy's health), replace it while the VM runs. */
export function networkRoutes(deps: NetworkRoutesDeps) {
  return (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    const params = z.object({ id: z.string().min(1).max(64) });

    app.get(
      '/v1/vms/:id/network',
      {
        schema: {
          tags: ['vms'],
          summary: "A VM's resolved egress: mode, provider, proxy endpoint and its health as the VM's host sees it",
          params,
          response: { 200: z.object({ egress: egressStatusSchema }), ...problemResponses },
        },
      },
      async (req) => ({ egress: await deps.vms.egressStatus(req.params.id, actorOf(req)) }),
    );

    app.put(
      '/v1/vms/:id/network',
      {
        schema: {
          tags: ['vms'],
          summary: "Replace a running VM's egress policy (the host applies it at once; existing connections that it forbids stop)",
          params,
          body: z.object({ egress: egressSpecSchema }).strict(),
          response: { 200: vmSchema.extend({ position: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        const r = await deps.vms.changeEgress(req.params.id, req.body.egress, actorOf(req));
        return { ...fromState(r.vm), position: r.position ?? null };
      },
    );
    return Promise.resolve();
  };
}
