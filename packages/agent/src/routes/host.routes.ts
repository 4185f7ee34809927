import type { FastifyInstance } from 'fastify';
import { AGENT_API_PREFIX, capacityResponseSchema, networkReassertResponseSchema, pruneResponseSchema } from '@fleet/agent-protocol';
import { pruneStaging } from '../artifacts.js';
import type { AgentRouteContext } from './context.js';
import type { Answer, RouteSchema } from './route-schema.js';

/** Each route's responses (route-schema.ts); none takes input. */
export const schemas = {
  capacity: { response: { 200: capacityResponseSchema } },
  prune: { response: { 200: pruneResponseSchema } },
  reassert: { response: { 200: networkReassertResponseSchema } },
} satisfies Record<string, RouteSchema>;

/** The host as a whole: capacity, prune of leftovers, network reassert. */
export function registerHostRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend, guestAgents, activePulls } = ctx;
  // ---- capacity ----------------------------------------------------------------
  app.get(`${AGENT_API_PREFIX}/capacity`, async (): Promise<Answer<typeof schemas.capacity, 200>> => {
    const [cap, vms] = await Promise.all([backend.capacity(), backend.list()]);
    return { ...cap, backend: backend.kind, vms_running: vms.filter((v) => v.state === 'running').length };
  });

  // ---- prune ----------------------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/prune`, async (): Promise<Answer<typeof schemas.prune, 200>> => {
    const report = await backend.prune();
    const known = new Set((await backend.list()).map((s) => s.name));
    const reclaimed = [
      ...report.bridges.map((b) => `bridge ${b}`),
      ...report.veths.map((v) => `veth ${v}`),
      ...report.mounts.map((m) => `mount ${m}`),
      ...report.loopDevices.map((l) => `loop ${l}`),
      ...report.directories.map((d) => `dir ${d}`),
      ...report.cgroups.map((c) => `cgroup ${c}`),
      ...report.processes.map((p) => `process ${p}`),
      ...report.tables.map((t) => `nftables table ${t}`),
      ...(await pruneStaging(backend, activePulls)),
      ...(await guestAgents.prune(known)),
    ];
    return { reclaimed, errors: report.errors };
  });

  // ---- network ------------------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/network/reassert`, async (): Promise<Answer<typeof schemas.reassert, 200>> => backend.reassertNetwork());
}
