import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import { NotFoundError } from '@fleet/agent-protocol';
import type { NetworkCommands, NetworkResult } from '../../commands/network/network-commands.js';
import { idSchema } from '../../domain/ids.js';
import { networkNameSchema } from '../../domain/network/network.events.js';
import { getNetwork, listNetworks, type NetworkRow } from '../../projections/networks/networks.queries.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import { commandMeta, positionSchema, problemResponses, waitForPosition } from './common.js';

const memberSchema = z.object({ vm_id: z.string(), ip: z.string(), host_id: z.string(), state: z.string() });
const networkSchema = z.object({
  id: z.string(),
  name: z.string(),
  subnet: z.string(),
  created_at: z.string(),
  /** Live members; a VM that ended has left and its address is free again. */
  members: z.array(memberSchema),
});

export interface NetworkRoutesDeps {
  readonly networks: NetworkCommands;
  readonly pool: Pool;
  readonly runner: ProjectionRunner;
  readonly readYourWritesTimeoutMs: number;
}

const fromResult = (r: NetworkResult): z.infer<typeof networkSchema> => ({
  id: r.network.network_id,
  name: r.network.name,
  subnet: r.network.subnet,
  created_at: r.network.created_at,
  members: [],
});

const fromRow = (r: NetworkRow): z.infer<typeof networkSchema> => ({ ...r });

/** Tenant networks (backend.go.txt CreateNetwork): a tenant sees and touches only its own; another's id is a 404. */
export function tenantNetworkRoutes(deps: NetworkRoutesDeps) {
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    const params = z.object({ id: idSchema });
    const after = z.object({ after: positionSchema.optional() });
    app.post(
      '/v1/networks',
      {
        schema: {
          tags: ['networks'],
          summary: 'Create a network; VMs created with its network_id reach each other and nothing else',
          body: z.object({ name: networkNameSchema, subnet: z.cidrv4().optional() }).strict(),
          response: { 201: networkSchema.extend({ position: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req, reply) => {
        const r = await deps.networks.create(req.body, { ...commandMeta(req), tenantId: req.caller.tenantId });
        return reply.status(201).send({ ...fromResult(r), position: r.position ?? null });
      },
    );
    app.get(
      '/v1/networks',
      {
        schema: {
          tags: ['networks'],
          summary: "The caller's networks",
          querystring: after,
          response: { 200: z.object({ networks: z.array(networkSchema) }), ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        return { networks: (await listNetworks(deps.pool, req.caller.tenantId)).map(fromRow) };
      },
    );
    app.get(
      '/v1/networks/:id',
      {
        schema: {
          tags: ['networks'],
          summary: 'One network with its live members',
          params,
          querystring: after,
          response: { 200: networkSchema, ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const row = await getNetwork(deps.pool, req.caller.tenantId, req.params.id);
        if (!row) throw new NotFoundError('NETWORK_NOT_FOUND', `network ${req.params.id} does not exist`);
        return fromRow(row);
      },
    );
    app.delete(
      '/v1/networks/:id',
      {
        schema: {
          tags: ['networks'],
          summary: 'Delete a network: refused (409 NETWORK_HAS_MEMBERS) while a member VM is live; idempotent',
          params,
          response: { 200: networkSchema.extend({ deleted: z.literal(true), position: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        const r = await deps.networks.delete(req.params.id, { ...commandMeta(req), tenantId: req.caller.tenantId });
        return { ...fromResult(r), deleted: true as const, position: r.position ?? null };
      },
    );
  };
}
