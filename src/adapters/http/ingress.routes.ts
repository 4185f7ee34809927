import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import type { IngressCommands } from '../../commands/ingress/ingress-commands.js';
import type { VmCommands } from '../../commands/vm/vm-commands.js';
import { problemResponses } from './common.js';
import { actorOf } from './vms.routes.js';

/** The VM's ingress grant for its owner: the traffic token private ports need, and each port's stable URL. */
export function ingressRoutes(deps: { readonly ingress: IngressCommands; readonly vms: VmCommands }) {
  return (scope: FastifyInstance): void => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    app.get(
      '/v1/vms/:id/ingress',
      {
        schema: {
          tags: ['vms'],
          summary: "The VM's traffic token (send it as X-Traffic-Token) and the ingress URL of each published port",
          params: z.object({ id: z.string().min(1).max(64) }),
          response: {
            200: z.object({
              vm_id: z.string(),
              traffic_token: z.string(),
              routes: z.array(z.object({ as: z.string(), port: z.number(), public: z.boolean(), url: z.string() })),
            }),
            ...problemResponses,
          },
        },
      },
      async (req, reply) => {
        // Tenancy first: another tenant's VM is a 404 like everywhere else.
        await deps.vms.get(req.params.id, actorOf(req));
        const grant = await deps.ingress.grant(req.params.id);
        void reply.header('cache-control', 'no-store');
        return { vm_id: req.params.id, traffic_token: grant.token, routes: grant.routes };
      },
    );
  };
}
