import type { FastifyInstance, FastifyRequest } from 'fastify';
import { z } from 'zod';
import { AGENT_API_PREFIX, AppError, checkpointIdSchema, createVmRequestSchema, pauseVmRequestSchema } from '@fleet/agent-protocol';
import { toWireCheckpoint } from '../artifacts.js';
import { gpuBindingRefusal, type LazyMemoryApi } from '../backend.js';
import { verifyGrant } from '../grants.js';
import { parse } from '../parse.js';
import { nameParam, toVmInfo, type AgentRouteContext } from './context.js';
import { checkpointId, paramOf } from './route-schema.js';

const checkpointParams = { id: checkpointId } as const;
const idParam = (req: FastifyRequest): string => paramOf(req, checkpointParams, 'id');

/**
 * Lazy (post-copy) moves, agent to agent (criu-lazy-sandbox.ts):
 *   source  POST /v1/vms/:name/lazy-pause       pause; pages stay pinned in a loopback page server
 *           GET  /v1/checkpoints/:id/pages       is that capture still pinned (and being pulled)?
 *           DELETE /v1/checkpoints/:id/pages     end it (abort: the target loses its VM)
 *           GET  /v1/artifacts/:id/pages         websocket to the page server, artifact grant auth
 *   target  POST /v1/vms/lazy                    create from the pulled checkpoint, memory paged in
 *           GET  /v1/vms/:name/memory            MemoryStatus
 */
export const lazyCreateRequestSchema = createVmRequestSchema.and(
  z.object({
    checkpoint_id: checkpointIdSchema,
    from: z
      .object({
        url: z.url({ protocol: /^https?$/ }),
        grant: z.string().min(1).max(1024),
      })
      .strict(),
  }),
);

export function registerLazyRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend, config, now } = ctx;
  const lazy = (): LazyMemoryApi => {
    if (!backend.lazy) throw new AppError('LAZY_PAGES_UNSUPPORTED', 409, 'this host cannot restore lazily (capacity lazy_pages is false)');
    return backend.lazy;
  };

  app.post(`${AGENT_API_PREFIX}/vms/:name/lazy-pause`, async (req) => {
    const name = nameParam(req);
    const body = parse(pauseVmRequestSchema, req.body ?? {}, 'lazy pause request');
    const cp = await lazy().pauseLazy(name, { ...(body.id ? { id: body.id } : {}), ...(body.comment ? { comment: body.comment } : {}) });
    return { vm: toVmInfo(await backend.get(name)), checkpoint: toWireCheckpoint(cp, name) };
  });

  app.get(`${AGENT_API_PREFIX}/checkpoints/:id/pages`, (req) => {
    const id = idParam(req);
    const src = lazy().source(id);
    return { checkpoint_id: id, pinned: src !== undefined, streaming: src?.streaming ?? false };
  });

  app.delete(`${AGENT_API_PREFIX}/checkpoints/:id/pages`, (req) => {
    const id = idParam(req);
    const src = lazy().source(id) as { release?: () => void } | undefined;
    src?.release?.();
    return { checkpoint_id: id, released: src !== undefined };
  });

  const checkGrant = (req: FastifyRequest, id: string): void => {
    const m = /^Bearer ([^\s]+)$/.exec(req.headers.authorization ?? '');
    if (!m) throw new AppError('GRANT_INVALID', 401, 'present an artifact grant as "Authorization: Bearer <grant>"');
    const check = verifyGrant(config.grantSecret, m[1] as string, id, now());
    if (check.ok) return;
    if (check.reason === 'expired') throw new AppError('GRANT_EXPIRED', 403, 'the artifact grant has expired');
    throw new AppError('GRANT_INVALID', 403, `the artifact grant is not valid for snapshot "${id}" on this host`);
  };

  app.route({
    method: 'GET',
    url: `${AGENT_API_PREFIX}/artifacts/:id/pages`,
    config: { auth: 'grant' },
    // Before the upgrade: a missing or wrong grant is an HTTP 401/403, never a socket.
    preValidation: (req, _reply, done) => {
      try {
        const id = idParam(req);
        checkGrant(req, id);
        if (!lazy().source(id)) throw new AppError('LAZY_PAGES_GONE', 410, `checkpoint "${id}" has no pages being served`);
        done();
      } catch (err) {
        done(err as Error);
      }
    },
    handler: () => {
      throw new AppError('WEBSOCKET_REQUIRED', 400, 'the pages stream over a websocket: connect with an Upgrade: websocket request');
    },
    wsHandler: (socket, req) => {
      let tcp;
      try {
        tcp = lazy().openPages(idParam(req));
      } catch (err) {
        socket.close(1008, (err as Error).message.slice(0, 120));
        return;
      }
      tcp.setNoDelay(true);
      // criu's page protocol is request/answer, so what is in flight stays small without more flow control.
      tcp.on('data', (d: Buffer) => {
        socket.send(d);
      });
      socket.on('message', (d: Buffer) => tcp.write(d));
      tcp.on('error', () => socket.terminate());
      socket.on('close', () => tcp.destroy());
      // The page server closes once the target has every page: a normal end of the stream.
      tcp.on('end', () => socket.close(1000));
    },
  });

  app.post(`${AGENT_API_PREFIX}/vms/lazy`, async (req, reply) => {
    const spec = parse(lazyCreateRequestSchema, req.body, 'lazy create request');
    const refused = gpuBindingRefusal({ gpuUuids: spec.gpu_uuids, migInstanceUuids: spec.mig_instance_uuids }, 'lazy restore (CRIU)');
    if (refused) throw refused;
    const info = await lazy().createLazy(
      {
        name: spec.name,
        checkpointId: spec.checkpoint_id,
        cpus: spec.cpus,
        ram_mb: spec.ram_mb,
        storage_gb: spec.storage_gb,
        tenant: spec.tenant,
        env: spec.env,
        expose: spec.expose,
        ...(spec.ip_hint ? { ipHint: spec.ip_hint } : {}),
        ...(spec.net_raw ? { net_raw: true } : {}),
        ...(spec.egress ? { egress: spec.egress } : {}),
        resume: true,
      },
      { url: spec.from.url, grant: spec.from.grant },
    );
    return reply.code(201).send(toVmInfo(info));
  });

  // A qemu VM's post-copy is QEMU's own: its backend answers without the CRIU lazy API.
  app.get(`${AGENT_API_PREFIX}/vms/:name/memory`, async (req) =>
    backend.memoryStatus && !backend.lazy ? backend.memoryStatus(nameParam(req)) : lazy().memoryStatus(nameParam(req)),
  );
}
