import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import type { VmCommands } from '../../commands/vm/vm-commands.js';
import { idSchema } from '../../domain/ids.js';
import { getVmHealth } from '../../projections/vm-health/vm-health.projection.js';
import { problemResponses } from './common.js';

const healthSchema = z.object({
  vm_id: z.string(),
  /** `none` until a verdict has been recorded (or when the VM declared no healthcheck). */
  state: z.enum(['none', 'starting', 'healthy', 'unhealthy']),
  since: z.string().nullable(),
  failures: z.number(),
  message: z.string(),
});

/** A VM's last health verdict (the seed's HealthStatus), for its tenant or an admin. */
export function vmHealthRoutes(deps: { readonly vms: VmCommands; readonly pool: Pool }) {
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    app.get(
      '/v1/vms/:id/health',
      {
        schema: {
          tags: ['vms'],
          summary: "The VM's healthcheck verdict, recorded by the reconciler when it changes (a failing probe reports, it never destroys)",
          params: z.object({ id: idSchema }),
          response: { 200: healthSchema, ...problemResponses },
        },
      },
      async (req) => {
        await deps.vms.get(req.params.id, { tenantId: req.caller.tenantId, admin: req.caller.admin });
        const h = await getVmHealth(deps.pool, req.params.id);
        return h
          ? {
              vm_id: req.params.id,
              state: h.state as 'starting' | 'healthy' | 'unhealthy',
              since: h.since,
              failures: h.failures,
              message: h.message,
            }
          : { vm_id: req.params.id, state: 'none' as const, since: null, failures: 0, message: '' };
      },
    );
  };
}
