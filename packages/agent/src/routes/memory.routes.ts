import type { FastifyInstance } from 'fastify';
import { AGENT_API_PREFIX, pauseVmRequestSchema, restoreVmRequestSchema } from '@fleet/agent-protocol';
import { toWireCheckpoint } from '../artifacts.js';
import { parse } from '../parse.js';
import { nameParam, toVmInfo, type AgentRouteContext } from './context.js';

/** Memory state (CRIU): pause and resume a sandbox, restore it to a checkpoint. Live checkpoints go through checkpoints.routes. */
export function registerMemoryRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend } = ctx;
  app.post(`${AGENT_API_PREFIX}/vms/:name/pause`, async (req) => {
    const name = nameParam(req);
    const body = parse(pauseVmRequestSchema, req.body ?? {}, 'pause request');
    const cp = await backend.pause(name, { ...(body.id ? { id: body.id } : {}), comment: body.comment });
    return { vm: toVmInfo(await backend.get(name)), checkpoint: toWireCheckpoint(cp, name) };
  });

  app.post(`${AGENT_API_PREFIX}/vms/:name/resume`, async (req) => toVmInfo(await backend.resume(nameParam(req))));

  app.post(`${AGENT_API_PREFIX}/vms/:name/restore`, async (req) => {
    const name = nameParam(req);
    const body = parse(restoreVmRequestSchema, req.body, 'restore request');
    return toVmInfo(await backend.restoreCheckpoint(name, body.checkpoint_id));
  });
}
