import { open } from 'node:fs/promises';
import { posix } from 'node:path';
import { Readable } from 'node:stream';
import type { FastifyInstance } from 'fastify';
import {
  AGENT_API_PREFIX,
  agentSpecSchema,
  consoleQuerySchema,
  createVmRequestSchema,
  destroyVmQuerySchema,
  listVmsQuerySchema,
  type Endpoint,
} from '@fleet/agent-protocol';
import { AppError, ConflictError } from '@fleet/agent-protocol';
import { parse } from '../parse.js';
import { isCode, nameParam, toVmInfo, type AgentRouteContext } from './context.js';
import { withOom } from './observe.routes.js';

/** Sandboxes: create, list, read, destroy, console tail, and the in-guest agent's start. */
export function registerVmRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend, guestAgents, checkedRun } = ctx;
  // ---- VMs -------------------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/vms`, async (req, reply) => {
    const spec = parse(createVmRequestSchema, req.body, 'create request');
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
      ...(spec.net_raw ? { net_raw: true } : {}),
      ...(spec.egress ? { egress: spec.egress } : {}),
      ...(spec.resume ? { resume: true } : {}),
    });
    const files = spec.files ?? [];
    if (files.length === 0) return reply.code(201).send(toVmInfo(info));
    try {
      for (const f of files) {
        const bytes = Buffer.from(f.content_b64, 'base64');
        if (bytes.length > ctx.config.maxUploadBytes)
          throw new AppError('FILE_TOO_LARGE', 413, `"${f.path}" is ${bytes.length} bytes, more than ${ctx.config.maxUploadBytes}`);
      }
      const dirs = [...new Set(files.map((f) => posix.dirname(posix.normalize(f.path))))].filter((d) => d !== '/');
      if (dirs.length > 0) await checkedRun(spec.name, ['mkdir', '-p', ...dirs], 'create the directories of the create files');
      for (const f of files) {
        await backend.writeGuestFile(spec.name, f.path, Readable.from([Buffer.from(f.content_b64, 'base64')]), {
          mode: parseInt(f.mode ?? '644', 8),
        });
      }
    } catch (err) {
      // All or nothing: a sandbox without its files (the fleet's token among them) is of no use to the caller.
      await backend.destroy(spec.name).catch(() => undefined);
      throw err;
    }
    return reply.code(201).send({ ...toVmInfo(info), files_written: files.length });
  });

  app.get(`${AGENT_API_PREFIX}/vms`, async (req) => {
    const q = parse(listVmsQuerySchema, req.query, 'query');
    const infos = await backend.list(q.prefix);
    // Whether an init died of an OOM kill is known after the monitor's next pass: the listing waits for it.
    if (infos.some((s) => s.state === 'stopped')) await backend.observer?.settleOom();
    return { vms: infos.map((s) => withOom(toVmInfo(s), backend)) };
  });

  app.get(`${AGENT_API_PREFIX}/vms/:name`, async (req) => {
    const info = await backend.get(nameParam(req));
    if (info.state === 'stopped') await backend.observer?.settleOom();
    return withOom(toVmInfo(info), backend);
  });

  app.delete(`${AGENT_API_PREFIX}/vms/:name`, async (req) => {
    const name = nameParam(req);
    const { force } = parse(destroyVmQuerySchema, req.query, 'query');
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
    const name = nameParam(req);
    const q = parse(consoleQuerySchema, req.query, 'query');
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
  app.post(`${AGENT_API_PREFIX}/vms/:name/agent`, async (req) => {
    const name = nameParam(req);
    const spec = parse(agentSpecSchema, req.body, 'agent spec');
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
