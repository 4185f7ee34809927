import type { FastifyInstance } from 'fastify';
import { AGENT_API_PREFIX, agentEgressSchema, egressStatusSchema, vmInfoSchema } from '@fleet/agent-protocol';
import { toVmInfo, type AgentRouteContext } from './context.js';
import { bodyOf, paramOf, part, sandboxName, type Answer, type RouteSchema } from './route-schema.js';

/** Each route's request parts and responses (route-schema.ts). */
export const schemas = {
  set: { params: { name: sandboxName }, body: part(agentEgressSchema, 'egress policy'), response: { 200: vmInfoSchema } },
  status: { params: { name: sandboxName }, response: { 200: egressStatusSchema } },
} satisfies Record<string, RouteSchema>;

/** A sandbox's outbound policy: replace it while it runs, read it with a probe of its proxy endpoint. */
export function registerEgressRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend } = ctx;
  app.put(`${AGENT_API_PREFIX}/vms/:name/egress`, async (req): Promise<Answer<typeof schemas.set, 200>> => {
    const name = paramOf(req, schemas.set.params, 'name');
    const egress = bodyOf(req, schemas.set.body);
    return toVmInfo(await backend.setEgress(name, egress));
  });

  app.get(`${AGENT_API_PREFIX}/vms/:name/egress`, async (req): Promise<Answer<typeof schemas.status, 200>> =>
    backend.egressStatus(paramOf(req, schemas.status.params, 'name')),
  );
}
