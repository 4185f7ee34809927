import { createHash, timingSafeEqual } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { open, stat } from 'node:fs/promises';
import type { IncomingMessage } from 'node:http';
import { posix } from 'node:path';
import { Readable } from 'node:stream';
import websocket from '@fastify/websocket';
import Fastify, { type FastifyBaseLogger, type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify';
import { z } from 'zod';
import {
  AGENT_API_PREFIX,
  agentSpecSchema,
  artifactFileNameSchema,
  artifactMoveSchema,
  checkpointIdSchema,
  consoleQuerySchema,
  createCheckpointRequestSchema,
  createGrantRequestSchema,
  createVmRequestSchema,
  destroyVmQuerySchema,
  execRequestSchema,
  filePathQuerySchema,
  listVmsQuerySchema,
  vmNameSchema,
  type CapacityResponse,
  type LayerUsageResponse,
  type Endpoint,
  type NetworkReassertResponse,
  type VmInfo,
} from '../domain/agent-protocol.js';
import { AppError, ConflictError, UnauthorizedError, ValidationError } from '../domain/errors.js';
import { buildManifest, parseRange, pruneStaging, pullArtifact, servableFile, toWireCheckpoint } from './artifacts.js';
import type { Backend, SandboxInfo } from './backend.js';
import { effectiveTimeout, runBuffered, runSession, type ExecLimits } from './exec.js';
import { mintGrant, verifyGrant } from './grants.js';
import { parse } from './parse.js';
import { GuestAgentStore } from './guest-agents.js';

export interface AgentAppConfig {
  token: string;
  grantSecret: Buffer;
  dataDir: string;
  execDefaultTimeoutMs: number;
  execMaxTimeoutMs: number;
  outputCapBytes: number;
  maxUploadBytes: number;
  pullTimeoutMs: number;
}

export interface AgentAppDeps {
  backend: Backend;
  config: AgentAppConfig;
  /** A pino logger; absent: no logs (tests). */
  logger?: FastifyBaseLogger;
  now?: () => number;
  version?: string;
}

declare module 'fastify' {
  interface FastifyContextConfig {
    /** 'grant': authenticated by an artifact grant in the handler, not the host token. 'none': /healthz. */
    auth?: 'grant' | 'none';
  }
}

const P = AGENT_API_PREFIX;

/** `max_bytes` on a download: the caller's cap, checked against the file's size before any byte moves. */
const downloadCapSchema = z.object({ max_bytes: z.coerce.number().int().nonnegative().optional() });

/** Builds the host agent's HTTP app (no listening: main.ts owns process concerns; tests use inject). */
export async function buildAgentApp(deps: AgentAppDeps): Promise<FastifyInstance> {
  const { backend, config } = deps;
  const now = deps.now ?? Date.now;
  const limits: ExecLimits = {
    defaultTimeoutMs: config.execDefaultTimeoutMs,
    maxTimeoutMs: config.execMaxTimeoutMs,
    outputCapBytes: config.outputCapBytes,
  };
  const guestAgents = new GuestAgentStore(config.dataDir);
  const activePulls = new Set<string>();
  const expectedDigest = sha256(Buffer.from(config.token, 'utf8'));

  const app = Fastify({
    ...(deps.logger ? { loggerInstance: deps.logger } : { logger: false }),
    bodyLimit: 64 * 1024 * 1024,
    // Checkpoints and pulls of large artifacts outlast the default timeouts.
    requestTimeout: 0,
    return503OnClosing: true,
  });

  await app.register(websocket, { options: { maxPayload: 16 * 1024 * 1024, perMessageDeflate: false } });

  // Uploads stream straight to disk: the body is handed over unparsed and capped while piping.
  app.addContentTypeParser('application/octet-stream', (_req, payload, done) => done(null, payload));

  app.addHook('onRequest', async (req) => {
    const auth = req.routeOptions.config?.auth;
    if (auth === 'none' || auth === 'grant') return;
    // Hash both sides: timingSafeEqual needs equal lengths, and the digest hides the token's length.
    const m = /^Bearer ([^\s]+)$/.exec(req.headers.authorization ?? '');
    const given = sha256(Buffer.from(m?.[1] ?? '', 'utf8'));
    if (!timingSafeEqual(given, expectedDigest) || !m) throw new UnauthorizedError('a valid bearer token for this host agent is required');
  });

  app.setErrorHandler((err: unknown, req, reply) => {
    const { status, body } = toProblem(err);
    if (status >= 500) req.log.error({ err, code: body.code }, 'request failed');
    else req.log.info({ code: body.code, status }, 'request refused');
    void reply.code(status).type('application/json').send(body);
  });
  app.setNotFoundHandler((req, reply) => {
    void reply.code(404).send({ code: 'NOT_FOUND', message: `no route ${req.method} ${req.url.split('?')[0]}` });
  });

  app.get('/healthz', { config: { auth: 'none' } }, async () => ({ ok: true, version: deps.version ?? '0' }));

  // ---- capacity ----------------------------------------------------------------
  app.get(`${P}/capacity`, async (): Promise<CapacityResponse> => {
    const [cap, vms] = await Promise.all([backend.capacity(), backend.list()]);
    return { ...cap, backend: backend.kind, vms_running: vms.filter((v) => v.state === 'running').length };
  });

  // ---- VMs -------------------------------------------------------------------
  app.post(`${P}/vms`, async (req, reply) => {
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
    });
    return reply.code(201).send(toVmInfo(info));
  });

  app.get(`${P}/vms`, async (req) => {
    const q = parse(listVmsQuerySchema, req.query, 'query');
    return { vms: (await backend.list(q.prefix)).map(toVmInfo) };
  });

  app.get(`${P}/vms/:name`, async (req) => toVmInfo(await backend.get(nameParam(req))));

  app.delete(`${P}/vms/:name`, async (req) => {
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
  app.get(`${P}/vms/:name/console`, async (req, reply) => {
    const name = nameParam(req);
    const q = parse(consoleQuerySchema, req.query, 'query');
    const info = await backend.get(name);
    const fh = await open(info.console_log, 'r').catch(() => undefined);
    if (!fh) return reply.type('text/plain; charset=utf-8').send('');
    try {
      const size = (await fh.stat()).size;
      const len = Math.min(size, q.tail_bytes);
      const buf = Buffer.alloc(len);
      await fh.read(buf, 0, len, size - len);
      return reply.type('text/plain; charset=utf-8').send(buf);
    } finally {
      await fh.close();
    }
  });

  // ---- exec -------------------------------------------------------------------
  app.post(`${P}/vms/:name/exec`, async (req, reply) => {
    const name = nameParam(req);
    const body = parse(execRequestSchema, req.body, 'exec request');
    const abort = new AbortController();
    // A caller that hangs up gets its command killed, not left running unobserved. (The response's
    // close, not the socket's: a keep-alive socket outlives many requests.)
    reply.raw.once('close', () => {
      if (!reply.raw.writableFinished) abort.abort();
    });
    return runBuffered(
      backend,
      name,
      {
        argv: body.argv,
        env: body.env,
        cwd: body.cwd,
        stdin: body.stdin !== undefined ? Buffer.from(body.stdin, 'base64') : undefined,
        timeoutMs: effectiveTimeout(body.timeout_ms, limits),
        encoding: body.encoding,
      },
      config.outputCapBytes,
      abort.signal,
    );
  });

  for (const mode of ['exec', 'attach'] as const) {
    app.route({
      method: 'GET',
      url: `${P}/vms/:name/${mode}`,
      handler: async () => {
        throw new ValidationError(`${mode} streams over a websocket: connect with an Upgrade: websocket request`, [], 'WEBSOCKET_REQUIRED');
      },
      wsHandler: (socket, req) => {
        const parsed = vmNameSchema.safeParse((req.params as { name?: string }).name);
        if (!parsed.success) {
          socket.send(JSON.stringify({ type: 'error', code: 'VALIDATION_FAILED', message: `name: ${parsed.error.issues[0]?.message}` }));
          socket.close(1008);
          return;
        }
        void runSession(backend, parsed.data, socket, mode, limits, req.log);
      },
    });
  }

  // ---- files ------------------------------------------------------------------
  app.put(`${P}/vms/:name/files`, async (req) => {
    const name = nameParam(req);
    const body = req.body as IncomingMessage | undefined;
    try {
      const q = parse(filePathQuerySchema, req.query, 'query');
      if (!body || typeof (body as { pipe?: unknown }).pipe !== 'function') {
        throw new AppError('UNSUPPORTED_MEDIA_TYPE', 415, 'send the file as the raw body with Content-Type: application/octet-stream');
      }
      // Written from inside the sandbox: a guest racing to swap a path component for a symlink cannot redirect it.
      const written = await backend.writeGuestFile(name, q.path, body, { maxBytes: config.maxUploadBytes, ...(q.mode ? { mode: parseInt(q.mode, 8) } : {}) });
      const size = written.bytes;
      return { path: q.path, size_bytes: size };
    } finally {
      // An early refusal must not leave the client blocked on an unread body.
      body?.resume?.();
    }
  });

  app.get(`${P}/vms/:name/files`, async (req, reply) => {
    const name = nameParam(req);
    const q = parse(filePathQuerySchema, req.query, 'query');
    const { max_bytes: maxBytes } = parse(downloadCapSchema, req.query, 'query');
    const file = await backend.readGuestFile(name, q.path);
    // The size is known before a byte is read: a file over the caller's cap is refused, and its reader stopped.
    if (maxBytes !== undefined && file.size > maxBytes) {
      file.stream.destroy();
      file.done.catch(() => undefined);
      throw new AppError('FILE_TOO_LARGE', 413, `"${file.path}" is ${file.size} bytes, more than the ${maxBytes} bytes asked for`, { size_bytes: file.size, max_bytes: maxBytes });
    }
    file.done.catch((err: unknown) => req.log.warn({ err: { message: (err as Error).message }, path: q.path }, 'download failed part-way'));
    return reply.type('application/octet-stream').header('content-length', file.size).send(file.stream);
  });

  // ---- in-guest agent -----------------------------------------------------------
  app.post(`${P}/vms/:name/agent`, async (req) => {
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

  // ---- checkpoints ----------------------------------------------------------------
  app.post(`${P}/vms/:name/checkpoints`, async (req, reply) => {
    const name = nameParam(req);
    const body = parse(createCheckpointRequestSchema, req.body ?? {}, 'checkpoint request');
    const cp = await backend.checkpoint(name, { comment: body.comment, live: body.live, ...(body.id ? { id: body.id } : {}), ...(body.max_bytes ? { maxBytes: body.max_bytes } : {}) });
    return reply.code(201).send(toWireCheckpoint(cp, name));
  });

  app.get(`${P}/vms/:name/layer-usage`, async (req): Promise<LayerUsageResponse> => backend.layerUsage(nameParam(req)));

  app.get(`${P}/checkpoints`, async () => ({ checkpoints: (await backend.listCheckpoints()).map((c) => toWireCheckpoint(c)) }));

  app.get(`${P}/checkpoints/:id`, async (req) => toWireCheckpoint(await backend.getCheckpoint(idParam(req))));

  app.delete(`${P}/checkpoints/:id`, async (req) => {
    const id = idParam(req);
    const existed = await backend.getCheckpoint(id).then(
      () => true,
      (err: unknown) => {
        if (isCode(err, 'CHECKPOINT_NOT_FOUND')) return false;
        throw err;
      },
    );
    await backend.deleteCheckpoint(id);
    return { id, deleted: existed };
  });

  // ---- artifacts --------------------------------------------------------------------
  app.post(`${P}/artifacts/grants`, async (req, reply) => {
    const body = parse(createGrantRequestSchema, req.body, 'grant request');
    await backend.getCheckpoint(body.snapshot_id);
    const expiresAt = now() + body.ttl_s * 1000;
    return reply.code(201).send({ snapshot_id: body.snapshot_id, grant: mintGrant(config.grantSecret, body.snapshot_id, expiresAt), expires_at: new Date(expiresAt).toISOString() });
  });

  const checkGrant = (req: FastifyRequest, id: string): void => {
    const m = /^Bearer ([^\s]+)$/.exec(req.headers.authorization ?? '');
    if (!m) throw new AppError('GRANT_INVALID', 401, 'present an artifact grant as "Authorization: Bearer <grant>"');
    const check = verifyGrant(config.grantSecret, m[1] as string, id, now());
    if (check.ok) return;
    if (check.reason === 'expired') throw new AppError('GRANT_EXPIRED', 403, 'the artifact grant has expired; ask the source host for a new one');
    if (check.reason === 'wrong_snapshot') throw new AppError('GRANT_INVALID', 403, `the artifact grant is not for snapshot "${id}"`);
    throw new AppError('GRANT_INVALID', 403, 'the artifact grant is not valid for this host');
  };

  app.get(`${P}/artifacts/:id/manifest`, { config: { auth: 'grant' } }, async (req) => {
    const id = idParam(req);
    checkGrant(req, id);
    return buildManifest(backend, id);
  });

  app.get(`${P}/artifacts/:id/files/:file`, { config: { auth: 'grant' } }, async (req, reply) => {
    const id = idParam(req);
    checkGrant(req, id);
    const file = parse(artifactFileNameSchema, (req.params as { file?: string }).file, 'file name');
    const path = await servableFile(backend, id, file);
    const size = (await stat(path)).size;
    void reply.header('accept-ranges', 'bytes').type('application/octet-stream');
    const range = parseRange(req.headers.range, size);
    if (range === 'unsatisfiable') {
      return reply.code(416).header('content-range', `bytes */${size}`).send({ code: 'RANGE_NOT_SATISFIABLE', message: `the file is ${size} bytes` });
    }
    if (range) {
      return reply
        .code(206)
        .header('content-range', `bytes ${range.start}-${range.end}/${size}`)
        .header('content-length', range.end - range.start + 1)
        .send(createReadStream(path, { start: range.start, end: range.end, highWaterMark: 1024 * 1024 }));
    }
    return reply.header('content-length', size).send(createReadStream(path, { highWaterMark: 1024 * 1024 }));
  });

  app.post(`${P}/artifacts/pull`, async (req) => {
    const move = parse(artifactMoveSchema, req.body, 'artifact move');
    return pullArtifact(backend, {
      snapshotId: move.snapshot_id,
      sourceSnapshotId: move.source_snapshot_id ?? move.snapshot_id,
      digest: move.digest,
      fromUrl: move.from.url,
      grant: move.from.grant,
      files: move.files,
      timeoutMs: config.pullTimeoutMs,
      active: activePulls,
    });
  });

  // ---- prune ----------------------------------------------------------------------
  app.post(`${P}/prune`, async () => {
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
  app.post(`${P}/network/reassert`, async (): Promise<NetworkReassertResponse> => backend.reassertNetwork());

  async function checkedRun(name: string, argv: string[], what: string, env: Record<string, string> = {}): Promise<string> {
    const res = await runBuffered(backend, name, { argv, env, timeoutMs: limits.defaultTimeoutMs, encoding: 'utf8' }, 64 * 1024, new AbortController().signal);
    if (res.exit_code !== 0 || res.timed_out) {
      throw new AppError('AGENT_START_FAILED', 422, `could not ${what} in the sandbox (exit ${res.exit_code}${res.timed_out ? ', timed out' : ''}): ${res.stderr.slice(0, 500)}`);
    }
    return res.stdout;
  }

  return app;
}

function sha256(b: Buffer): Buffer {
  return createHash('sha256').update(b).digest();
}

function toVmInfo(s: SandboxInfo): VmInfo {
  return {
    name: s.name,
    state: s.state,
    image: s.image,
    tenant: s.tenant,
    ...(s.ip ? { ip: s.ip } : {}),
    ...(s.mac ? { mac: s.mac } : {}),
    cpus: s.cpus,
    ram_mb: s.ram_mb,
    created_at: s.created_at,
    ...(s.checkpoint_id ? { from_checkpoint: s.checkpoint_id } : {}),
    endpoints: s.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol })),
  };
}

function nameParam(req: FastifyRequest): string {
  return parse(vmNameSchema, (req.params as { name?: string }).name, 'sandbox name');
}

function idParam(req: FastifyRequest): string {
  return parse(checkpointIdSchema, (req.params as { id?: string }).id, 'checkpoint id');
}

function isCode(err: unknown, code: string): boolean {
  return err instanceof AppError && err.code === code;
}

/** Maps anything thrown to `{code, message, details?}`; a 5xx never leaks an unexpected error's message. */
export function toProblem(err: unknown): { status: number; body: { code: string; message: string; details?: Record<string, unknown> } } {
  if (err instanceof AppError) {
    const body = { code: err.code, message: err.message, ...(err.details ? { details: { ...err.details } } : {}) };
    return { status: err.status, body };
  }
  const e = err as { code?: string; statusCode?: number; message?: string };
  if (e && typeof e.statusCode === 'number' && e.statusCode >= 400 && e.statusCode < 500) {
    const code =
      e.code === 'FST_ERR_CTP_BODY_TOO_LARGE'
        ? 'PAYLOAD_TOO_LARGE'
        : e.code === 'FST_ERR_CTP_INVALID_MEDIA_TYPE'
          ? 'UNSUPPORTED_MEDIA_TYPE'
          : 'VALIDATION_FAILED';
    return { status: e.statusCode, body: { code, message: e.message ?? 'bad request' } };
  }
  const errno = e?.code;
  if (errno === 'ENOENT') return { status: 404, body: { code: 'NOT_FOUND', message: 'no such file' } };
  if (errno === 'ENOSPC') return { status: 507, body: { code: 'HOST_CAPACITY_EXHAUSTED', message: 'this host is out of disk space' } };
  return { status: 500, body: { code: 'AGENT_ERROR', message: 'internal error in the host agent; see its log' } };
}

