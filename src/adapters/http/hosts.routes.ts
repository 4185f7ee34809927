import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import { registerHostRequestSchema, type HostCommands } from '../../commands/host/host-commands.js';
import { hostCapacitySchema } from '@fleet/agent-protocol';
import { NotFoundError } from '@fleet/agent-protocol';
import { idSchema } from '../../domain/ids.js';
import { getHost, listHosts } from '../../projections/hosts/hosts.queries.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import { adminOnly } from './auth.js';
import { decodeCursor, encodeCursor, pageQuery } from './pagination.js';
import { commandMeta, positionSchema, problemResponses, waitForPosition } from './common.js';

const hostSchema = z.object({
  id: z.string(),
  url: z.string(),
  region: z.string(),
  backend: z.string(),
  labels: z.record(z.string(), z.string()),
  capacity: hostCapacitySchema,
  arch: z.string(),
  state: z.string(),
  allocated: z.object({ cpus: z.number(), ram_mb: z.number(), storage_gb: z.number(), vm_count: z.number(), gpus: z.number() }),
  last_seen: z.string(),
  created_at: z.string(),
  updated_at: z.string(),
});

const commandResult = z.object({ host_id: z.string(), state: z.string(), position: z.string().nullable() });

export interface HostRoutesDeps {
  readonly hosts: HostCommands;
  readonly pool: Pool;
  readonly runner: ProjectionRunner;
  readonly readYourWritesTimeoutMs: number;
}

/** Host registry: admin only. Reads come from the `hosts` read model; `?after=` waits for it to catch up. */
export function hostRoutes(deps: HostRoutesDeps) {
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    adminOnly(scope);
    const params = z.object({ id: idSchema });

    app.post(
      '/v1/hosts',
      {
        schema: {
          tags: ['hosts'],
          summary: 'Register a host (probes its agent first)',
          body: registerHostRequestSchema,
          response: { 201: commandResult, ...problemResponses },
        },
      },
      async (req, reply) => {
        const r = await deps.hosts.register(req.body, commandMeta(req));
        return reply.status(201).send({ host_id: req.body.id, state: r.state.status, position: r.position ?? null });
      },
    );

    app.get(
      '/v1/hosts',
      {
        schema: {
          tags: ['hosts'],
          summary: 'List hosts',
          querystring: z.object({
            ...pageQuery,
            after: positionSchema.optional(),
            include_deregistered: z.enum(['true', 'false']).default('false'),
          }),
          response: { 200: z.object({ hosts: z.array(hostSchema), next_cursor: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const after = decodeCursor(req.query.cursor, z.string());
        const rows = await listHosts(deps.pool, {
          limit: req.query.limit,
          after,
          includeDeregistered: req.query.include_deregistered === 'true',
        });
        const last = rows.at(-1);
        return { hosts: rows, next_cursor: rows.length === req.query.limit && last ? encodeCursor(last.id) : null };
      },
    );

    app.get(
      '/v1/hosts/:id',
      {
        schema: {
          tags: ['hosts'],
          summary: 'Get a host',
          params,
          querystring: z.object({ after: positionSchema.optional() }),
          response: { 200: hostSchema, ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const row = await getHost(deps.pool, req.params.id);
        if (!row) throw new NotFoundError('HOST_NOT_FOUND', `host ${req.params.id} is not registered`);
        return row;
      },
    );

    for (const [action, title] of [
      ['cordon', 'Cordon'],
      ['uncordon', 'Uncordon'],
      ['probe', 'Probe'],
    ] as const) {
      app.post(
        `/v1/hosts/:id/${action}`,
        {
          schema: {
            tags: ['hosts'],
            summary: `${title} a host`,
            params,
            body: z
              .object({ reason: z.string().max(500).optional() })
              .strict()
              .nullish(),
            response: { 200: commandResult, ...problemResponses },
          },
        },
        async (req) => {
          const meta = commandMeta(req);
          const r =
            action === 'cordon'
              ? await deps.hosts.cordon(req.params.id, req.body?.reason, meta)
              : action === 'uncordon'
                ? await deps.hosts.uncordon(req.params.id, meta)
                : await deps.hosts.probe(req.params.id, meta);
          return { host_id: req.params.id, state: r.state.status, position: r.position ?? null };
        },
      );
    }

    app.delete(
      '/v1/hosts/:id',
      {
        schema: {
          tags: ['hosts'],
          summary: 'Deregister a host (refused while it holds VMs unless force=true)',
          params,
          querystring: z.object({ force: z.enum(['true', 'false']).default('false') }),
          response: { 200: commandResult, ...problemResponses },
        },
      },
      async (req) => {
        const r = await deps.hosts.deregister(req.params.id, req.query.force === 'true', commandMeta(req));
        return { host_id: req.params.id, state: r.state.status, position: r.position ?? null };
      },
    );
  };
}
