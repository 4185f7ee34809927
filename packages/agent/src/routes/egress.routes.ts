import type { FastifyInstance } from 'fastify';
import { AGENT_API_PREFIX, agentEgressSchema } from '@fleet/agent-protocol';
import { parse } from '../parse.js';
import { nameParam, toVmInfo, type AgentRouteContext } from './context.js';

/** A sandbox's outbound policy: replace it while it runs, read it with a probe of its proxy endpoint. */
export function registerEgressRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend } = ctx;
  app.put(`${AGENT_API_PREFIX}/vms/:name/egress`, async (req) => {
    const name = nameParam(req);
    const egress = parse(agentEgressSchema, req.body, 'egress policy');
    return toVmInfo(await backend.setEgress(name, egress));
  });

  app.get(`${AGENT_API_PREFIX}/vms/:name/egress`, async (req) => backend.egressStatus(nameParam(req)));
}
