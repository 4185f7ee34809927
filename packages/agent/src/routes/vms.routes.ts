import { open } from 'node:fs/promises';
import { posix } from 'node:path';
import { Readable } from 'node:stream';
import type { FastifyInstance } from 'fastify';
import { z } from 'zod';
import {
  AGENT_API_PREFIX,
  agentSpecSchema,
  consoleQuerySchema,
  createVmRequestSchema,
  destroyVmQuerySchema,
  destroyVmResponseSchema,
  listVmsQuerySchema,
  listVmsResponseSchema,
  startAgentResponseSchema,
  vmInfoSchema,
  type Endpoint,
} from '@fleet/agent-protocol';
import { AppError, ConflictError } from '@fleet/agent-protocol';
import { isCode, toVmInfo, type AgentRouteContext } from './context.js';
import { withInitExit, withOom } from './observe.routes.js';
import { bodyOf, paramOf, part, queryOf, sandboxName, type Answer, type RouteSchema } from './route-schema.js';

/** Each route's request parts and responses (route-schema.ts). */
export const schemas = {
  create: { body: part(createVmRequestSchema, 'create request'), response: { 201: vmInfoSchema } },
  list: { querystring: part(listVmsQuerySchema, 'query'), response: { 200: listVmsResponseSchema } },
  get: { params: { name: sandboxName }, response: { 200: vmInfoSchema } },
  destroy: {
    params: { name: sandboxName },
    querystring: part(destroyVmQuerySchema, 'query'),
    response: { 200: destroyVmResponseSchema },
  },
  /** text/plain: the tail of the console log. */
  console: {
    params: { name: sandboxName },
    querystring: part(consoleQuerySchema, 'query'),
    response: { 200: z.union([z.string(), z.instanceof(Buffer)]) },
  },
  startAgent: { params: { name: sandboxName }, body: part(agentSpecSchema, 'agent spec'), response: { 200: startAgentResponseSchema } },
} satisfies Record<string, RouteSchema>;

/** Sandboxes: create, list, read, destroy, console tail, and the in-guest agent's start. */
export function registerVmRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend, guestAgents, checkedRun } = ctx;
  // ---- VMs -------------------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/vms`, async (req, reply) => {
    const spec = bodyOf(req, schemas.create.body);
    // The route's own steps, beside the backend's `create timings` (bench tti --agent-timings reads both).
    const t0 = performance.now();
    const phases: Record<string, number> = {};
    const mark = (phase: string): void => {
      phases[phase] = Math.round((performance.now() - t0) * 10) / 10;
    };
    const info = await backend.create({
      name: spec.name,
      ...(spec.image ? { image: spec.image } : {}),
      ...(spec.checkpoint_id ? { checkpointId: spec.checkpoint_id } : {}),
      cpus: spec.cpus,
      ram_mb: spec.ram_mb,
      storage_gb: spec.storage_gb,
      tenant: spec.tenant,
      env: spec.env,
      expose: spec.expose,
      ...(spec.ip_hint ? { ipHint: spec.ip_hint } : {}),
      ...(spec.network ? { network: spec.network } : {}),
      ...(spec.net_raw ? { net_raw: true } : {}),
      ...(spec.egress ? { egress: spec.egress } : {}),
      ...(spec.resume ? { resume: true } : {}),
      ...(spec.gpu_uuids?.length ? { gpuUuids: spec.gpu_uuids } : {}),
      ...(spec.mig_instance_uuids?.length ? { migInstanceUuids: spec.mig_instance_uuids } : {}),
    });
    mark('route.created');
    const files = spec.files ?? [];
    if (files.length === 0) return reply.code(201).send(toVmInfo(info) satisfies Answer<typeof schemas.create, 201>);
    try {
      for (const f of files) {
        const bytes = Buffer.from(f.content_b64, 'base64');
        if (bytes.length > ctx.config.maxUploadBytes)
          throw new AppError('FILE_TOO_LARGE', 413, `"${f.path}" is ${bytes.length} bytes, more than ${ctx.config.maxUploadBytes}`);
      }
      // Each file's directories are made by the same helper that writes it (parents): no `mkdir -p` exec first.
      for (const f of files) {
        await backend.writeGuestFile(spec.name, f.path, Readable.from([Buffer.from(f.content_b64, 'base64')]), {
          mode: parseInt(f.mode ?? '644', 8),
          parents: true,
        });
      }
      mark('route.files');
    } catch (err) {
      // All or nothing: a sandbox without its files (the fleet's token among them) is of no use to the caller.
      await backend.destroy(spec.name).catch(() => undefined);
      throw err;
    }
    req.log.debug({ sandbox: spec.name, phases_ms: phases }, 'create route timings');
    return reply.code(201).send({ ...toVmInfo(info), files_written: files.length } satisfies Answer<typeof schemas.create, 201>);
  });

  app.get(`${AGENT_API_PREFIX}/vms`, async (req): Promise<Answer<typeof schemas.list, 200>> => {
    const q = queryOf(req, schemas.list.querystring);
    const infos = await backend.list(q.prefix);
    // Whether an init died of an OOM kill is known after the monitor's next pass: the listing waits for it.
    if (infos.some((s) => s.state === 'stopped')) await backend.observer?.settleOom();
    return { vms: await Promise.all(infos.map((s) => withInitExit(withOom(toVmInfo(s), backend), backend))) };
  });

  app.get(`${AGENT_API_PREFIX}/vms/:name`, async (req): Promise<Answer<typeof schemas.get, 200>> => {
    const info = await backend.get(paramOf(req, schemas.get.params, 'name'));
    if (info.state === 'stopped') await backend.observer?.settleOom();
    return withInitExit(withOom(toVmInfo(info), backend), backend);
  });

  app.delete(`${AGENT_API_PREFIX}/vms/:name`, async (req): Promise<Answer<typeof schemas.destroy, 200>> => {
    const name = paramOf(req, schemas.destroy.params, 'name');
    const { force } = queryOf(req, schemas.destroy.querystring);
    const existed = await backend.get(name).then(
      () => true,
      (err: unknown) => {
        if (isCode(err, 'SANDBOX_NOT_FOUND')) return false;
        throw err;
      },
    );
    if (!existed) {
      await guestAgents.forget(name);
      return { name, destroyed: false, drained: false };
    }
    const drain = force ? '' : await guestAgents.drainCommand(name);
    await backend.destroy(name, { drainCommand: drain, ...(force ? { graceMs: 500 } : {}) });
    await guestAgents.forget(name);
    return { name, destroyed: true, drained: drain !== '' };
  });

  // The serial-style log of the sandbox's init: its tail, as text.
  app.get(`${AGENT_API_PREFIX}/vms/:name/console`, async (req, reply) => {
    const name = paramOf(req, schemas.console.params, 'name');
    const q = queryOf(req, schemas.console.querystring);
    const info = await backend.get(name);
    const fh = await open(info.console_log, 'r').catch(() => undefined);
    if (!fh) return reply.type('text/plain; charset=utf-8').send('');
    let buf: Buffer;
    try {
      const size = (await fh.stat()).size;
      const len = Math.min(size, q.tail_bytes);
      buf = Buffer.alloc(len);
      await fh.read(buf, 0, len, size - len);
    } finally {
      await fh.close();
    }
    return reply.type('text/plain; charset=utf-8').send(buf);
  });

  // ---- in-guest agent -----------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/vms/:name/agent`, async (req): Promise<Answer<typeof schemas.startAgent, 200>> => {
    const name = paramOf(req, schemas.startAgent.params, 'name');
    const spec = bodyOf(req, schemas.startAgent.body);
    const info = await backend.get(name);
    const endpoints: Endpoint[] = [];
    for (const want of spec.expose) {
      const ep = info.endpoints.find((e) => e.port === want.port && e.protocol === want.protocol);
      if (!ep) {
        throw new ConflictError(
          'EXPOSE_NOT_PUBLISHED',
          `guest port ${want.port}/${want.protocol} is not published: list it under "expose" when creating the sandbox`,
          { port: want.port, protocol: want.protocol },
        );
      }
      endpoints.push({ as: want.as, url: ep.url, port: ep.port, protocol: ep.protocol });
    }
    const files = Object.entries(spec.files);
    if (files.length > 0) {
      const dirs = [...new Set(files.map(([p]) => posix.dirname(posix.normalize(p))))];
      await checkedRun(name, ['mkdir', '-p', ...dirs], 'create the directories of the agent files');
      for (const [path, b64] of files) {
        await backend.writeGuestFile(name, path, Readable.from([Buffer.from(b64, 'base64')]), { mode: 0o755 });
      }
    }
    // Detached from this exec (own session, output to a guest log), so it outlives the request and the agent.
    const launch =
      'mkdir -p /var/log 2>/dev/null; ' +
      'if command -v setsid >/dev/null 2>&1; then setsid sh -c "$1" </dev/null >>/var/log/guest-agent.log 2>&1 & ' +
      'else sh -c "$1" </dev/null >>/var/log/guest-agent.log 2>&1 & fi; echo $!';
    const res = await checkedRun(name, ['/bin/sh', '-c', launch, 'sh', spec.command], 'start the agent command', spec.env);
    await guestAgents.setDrainCommand(name, spec.drain_command);
    const pid = Number.parseInt(res.trim(), 10);
    return { started: true, ...(Number.isFinite(pid) ? { pid } : {}), endpoints };
  });
}
