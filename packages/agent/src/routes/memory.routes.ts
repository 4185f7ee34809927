import type { FastifyInstance } from 'fastify';
import { AGENT_API_PREFIX, pauseVmRequestSchema, pauseVmResponseSchema, restoreVmRequestSchema, vmInfoSchema } from '@fleet/agent-protocol';
import { toWireCheckpoint } from '../artifacts.js';
import { toVmInfo, type AgentRouteContext } from './context.js';
import { bodyOf, paramOf, part, sandboxName, type Answer, type RouteSchema } from './route-schema.js';

/** Each route's request parts and responses (route-schema.ts). */
export const schemas = {
  pause: {
    params: { name: sandboxName },
    body: part(pauseVmRequestSchema, 'pause request', { absent: {} }),
    response: { 200: pauseVmResponseSchema },
  },
  resume: { params: { name: sandboxName }, response: { 200: vmInfoSchema } },
  restore: { params: { name: sandboxName }, body: part(restoreVmRequestSchema, 'restore request'), response: { 200: vmInfoSchema } },
} satisfies Record<string, RouteSchema>;

/** Memory state (CRIU): pause and resume a sandbox, restore it to a checkpoint. Live checkpoints go through checkpoints.routes. */
export function registerMemoryRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend } = ctx;
  app.post(`${AGENT_API_PREFIX}/vms/:name/pause`, async (req): Promise<Answer<typeof schemas.pause, 200>> => {
    const name = paramOf(req, schemas.pause.params, 'name');
    const body = bodyOf(req, schemas.pause.body);
    const cp = await backend.pause(name, { ...(body.id ? { id: body.id } : {}), comment: body.comment });
    return { vm: toVmInfo(await backend.get(name)), checkpoint: toWireCheckpoint(cp, name) };
  });

  app.post(`${AGENT_API_PREFIX}/vms/:name/resume`, async (req): Promise<Answer<typeof schemas.resume, 200>> =>
    toVmInfo(await backend.resume(paramOf(req, schemas.resume.params, 'name'))),
  );

  app.post(`${AGENT_API_PREFIX}/vms/:name/restore`, async (req): Promise<Answer<typeof schemas.restore, 200>> => {
    const name = paramOf(req, schemas.restore.params, 'name');
    const body = bodyOf(req, schemas.restore.body);
    return toVmInfo(await backend.restoreCheckpoint(name, body.checkpoint_id));
  });
}
