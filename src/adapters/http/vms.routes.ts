import type { FastifyInstance, FastifyRequest } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { Readable } from 'node:stream';
import type { WebSocket } from '@fastify/websocket';
import type { RawData } from 'ws';
import { z } from 'zod';
import type { Actor, VmCommands } from '../../commands/vm/vm-commands.js';
import { attachStartSchema, clientFrameSchema, execResultSchema, execStreamStartSchema } from '@fleet/agent-protocol';
import type { AgentStream } from '../../domain/host-agent.port.js';
import { AppError, NotFoundError, describeFields, fieldsFromZod } from '@fleet/agent-protocol';
import { placementDecisionSchema } from '../../domain/placement/placement.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import { publicSpec, vmSpecSchema } from '../../domain/vm/spec.js';
import { vmStatusSchema } from '../../domain/vm/vm.events.js';
import type { ProjectionRunner } from '../../projections/runner.js';
import { getVm, listVms, type VmRow } from '../../projections/vms/vms.queries.js';
import type { EventStore } from '../../domain/event-store.port.js';
import { parseAsOf, vmAsOf } from './audit.routes.js';
import { commandMeta, positionSchema, problemResponses, waitForPosition } from './common.js';
import { cursorTime, decodeCursor, encodeCursor, pageQuery } from './pagination.js';
import { problem } from './problem.js';
import { lifecycleOfRow, lifecycleOfState, metadataFilter, vmLifecycleFields, vmLifecycleListQuery } from './vm-lifecycle-fields.js';

const endpointOut = z.object({ as: z.string(), url: z.string(), port: z.number(), protocol: z.string().optional() });

export const vmSchema = z.object({
  id: z.string(),
  tenant_id: z.string(),
  task_id: z.string().nullable(),
  state: z.string(),
  host_id: z.string().nullable(),
  url: z.string().nullable(),
  endpoints: z.array(endpointOut),
  spec: z.record(z.string(), z.unknown()),
  reason: z.string().nullable(),
  error: z.string().nullable(),
  error_code: z.string().nullable(),
  boot_ms: z.number().nullable(),
  created_at: z.string(),
  updated_at: z.string(),
  ...vmLifecycleFields,
});
type VmOut = z.infer<typeof vmSchema>;

const vmCommandResult = vmSchema.extend({ position: z.string().nullable() });

function fromRow(r: VmRow): VmOut {
  return {
    id: r.id,
    tenant_id: r.tenant_id,
    task_id: r.task_id,
    state: r.state,
    host_id: r.host_id,
    url: r.url,
    endpoints: r.endpoints,
    spec: r.spec,
    reason: r.reason,
    error: r.error,
    error_code: r.error_code,
    boot_ms: r.boot_ms,
    created_at: r.created_at,
    updated_at: r.updated_at,
    ...lifecycleOfRow(r),
  };
}

export function fromState(s: ExistingVmState): VmOut {
  return {
    id: s.vm_id,
    tenant_id: s.tenant_id,
    task_id: s.task_id ?? null,
    state: s.status,
    host_id: s.host_id ?? null,
    url: s.url ?? null,
    endpoints: [...s.endpoints],
    spec: publicSpec(s.spec),
    reason: s.status === 'destroyed' || s.status === 'failed' ? s.reason : s.status === 'destroying' ? s.destroy_reason : null,
    error: s.status === 'failed' ? s.error : null,
    error_code: s.status === 'failed' ? (s.error_code ?? null) : null,
    boot_ms: s.boot_ms ?? null,
    created_at: s.requested_at,
    updated_at: s.transitioned_at,
    ...lifecycleOfState(s),
  };
}

export interface VmStreamLimits {
  /** FILE_MAX_BYTES: the largest file moved either way. */
  readonly fileMaxBytes: number;
  /** POST /v1/vms carries inline files (16 MiB decoded, as base64): its own body limit. */
  readonly createBodyLimit: number;
  readonly sessionsPerVm: number;
  readonly sessionsPerTenant: number;
  /** 0: no idle timeout. */
  readonly attachIdleTimeoutMs: number;
}

export const DEFAULT_VM_STREAM_LIMITS: VmStreamLimits = {
  fileMaxBytes: 1024 * 1024 * 1024,
  createBodyLimit: 24 * 1024 * 1024,
  sessionsPerVm: 8,
  sessionsPerTenant: 32,
  attachIdleTimeoutMs: 30 * 60_000,
};

export interface VmRoutesDeps {
  readonly limits?: Partial<VmStreamLimits> | undefined;
  readonly vms: VmCommands;
  readonly pool: Pool;
  readonly runner: ProjectionRunner;
  readonly readYourWritesTimeoutMs: number;
  /** For `?as_of=`: the VM's own events are folded up to that point. */
  readonly store?: EventStore | undefined;
}

export function actorOf(req: FastifyRequest): Actor {
  return { ...commandMeta(req), tenantId: req.caller.tenantId, admin: req.caller.admin };
}

/** Tenants see and touch only their own VMs; another tenant's id is a 404 (its existence is not revealed). */
export function vmRoutes(deps: VmRoutesDeps) {
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    const params = z.object({ id: z.string().min(1).max(64) });
    const limits: VmStreamLimits = { ...DEFAULT_VM_STREAM_LIMITS, ...deps.limits };
    const sessions = new SessionCounter(limits);
    const readScope = (req: FastifyRequest): string | undefined => (req.caller.admin ? undefined : req.caller.tenantId);

    app.post(
      '/v1/vms',
      {
        bodyLimit: limits.createBodyLimit,
        schema: {
          tags: ['vms'],
          summary: 'Create a VM: place it, boot it, and answer when it runs',
          body: vmSpecSchema,
          headers: z.object({ 'idempotency-key': z.string().min(1).max(200).optional() }).loose(),
          response: { 201: vmCommandResult, 200: vmCommandResult, ...problemResponses },
        },
      },
      async (req, reply) => {
        const r = await deps.vms.create(req.body, actorOf(req), req.headers['idempotency-key']);
        return reply.status(r.position ? 201 : 200).send({ ...fromState(r.vm), position: r.position ?? null });
      },
    );

    app.get(
      '/v1/vms',
      {
        schema: {
          tags: ['vms'],
          summary: 'List VMs (newest first)',
          querystring: z.object({
            ...pageQuery,
            state: vmStatusSchema.optional(),
            task_id: z.string().max(200).optional(),
            host_id: z.string().max(64).optional(),
            after: positionSchema.optional(),
            ...vmLifecycleListQuery,
          }),
          response: { 200: z.object({ vms: z.array(vmSchema), next_cursor: z.string().nullable() }), ...problemResponses },
        },
      },
      async (req) => {
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const after = decodeCursor(req.query.cursor, z.object({ created_at: cursorTime, id: z.string() }));
        const rows = await listVms(deps.pool, {
          tenantId: readScope(req),
          state: req.query.state,
          taskId: req.query.task_id,
          hostId: req.query.host_id,
          reason: req.query.reason,
          metadata: metadataFilter(req.query.metadata),
          limit: req.query.limit,
          after,
        });
        const last = rows.at(-1);
        return {
          vms: rows.map(fromRow),
          next_cursor: rows.length === req.query.limit && last ? encodeCursor({ created_at: last.created_at, id: last.id }) : null,
        };
      },
    );

    app.get(
      '/v1/vms/:id',
      {
        schema: {
          tags: ['vms'],
          summary: 'Get a VM (as_of: as it was at that time or position, folded from its events)',
          params,
          querystring: z.object({ after: positionSchema.optional(), as_of: z.string().min(1).optional() }),
          response: { 200: vmSchema, ...problemResponses },
        },
      },
      async (req) => {
        if (req.query.as_of !== undefined && deps.store) {
          const then = await vmAsOf(deps.store, req.params.id, parseAsOf(deps.store, req.query.as_of));
          if (!then || (!req.caller.admin && then.state.tenant_id !== req.caller.tenantId))
            throw new NotFoundError('VM_NOT_FOUND', `vm ${req.params.id} did not exist at ${req.query.as_of}`, { vm_id: req.params.id });
          return fromState(then.state);
        }
        await waitForPosition(deps.runner, req.query.after, deps.readYourWritesTimeoutMs);
        const row = await getVm(deps.pool, req.params.id, readScope(req));
        if (!row) throw new NotFoundError('VM_NOT_FOUND', `vm ${req.params.id} does not exist`, { vm_id: req.params.id });
        return fromRow(row);
      },
    );

    app.delete(
      '/v1/vms/:id',
      {
        schema: { tags: ['vms'], summary: 'Destroy a VM (idempotent)', params, response: { 200: vmCommandResult, ...problemResponses } },
      },
      async (req) => {
        const r = await deps.vms.destroy(req.params.id, actorOf(req));
        return { ...fromState(r.vm), position: r.position ?? null };
      },
    );

    app.get(
      '/v1/vms/:id/placement',
      {
        schema: {
          tags: ['vms'],
          summary: 'Why the VM is where it is',
          params,
          response: { 200: placementDecisionSchema, ...problemResponses },
        },
      },
      async (req) => {
        const vm = await deps.vms.get(req.params.id, actorOf(req));
        if (!vm.decision) throw new AppError('VM_NOT_PLACED', 409, `vm ${req.params.id} has not been placed (it is ${vm.status})`);
        return vm.decision;
      },
    );

    app.post(
      '/v1/vms/:id/exec',
      {
        schema: {
          tags: ['vms'],
          summary: 'Run a command in the VM; a non-zero exit code is a result, not an error',
          params,
          body: z
            .object({
              argv: z
                .array(z.string().max(64 * 1024))
                .min(1, 'argv needs at least the program to run')
                .max(4096),
              env: z.record(z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/, 'an environment variable name'), z.string()).optional(),
              cwd: z.string().startsWith('/', 'cwd must be an absolute path').optional(),
              timeout_ms: z.number().int().nonnegative().optional(),
              stdin: z.base64('stdin must be base64').optional(),
            })
            .strict(),
          response: { 200: execResultSchema, ...problemResponses },
        },
      },
      async (req) => deps.vms.exec(req.params.id, req.body, actorOf(req)),
    );

    app.get(
      '/v1/vms/:id/files',
      {
        schema: {
          tags: ['vms'],
          summary: 'Download a file from the VM (streamed; larger than FILE_MAX_BYTES: 413 FILE_TOO_LARGE)',
          params,
          querystring: z.object({ path: z.string().min(1).max(4096) }),
        },
      },
      async (req, reply) => {
        const file = await deps.vms.download(req.params.id, req.query.path, actorOf(req), limits.fileMaxBytes);
        // Streamed as the client takes it; a client that goes away ends the generator, which stops the agent's transfer.
        const stream = Readable.from(file.body, { objectMode: false, highWaterMark: 256 * 1024 });
        stream.on('error', (err) => req.log.warn({ err: { message: err.message }, vm_id: req.params.id }, 'download broke part-way'));
        return reply.type('application/octet-stream').header('content-length', file.size).send(stream);
      },
    );

    // Uploads in a scope of their own: only here is an octet-stream body handed over unread, to be streamed to the agent.
    // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
    await scope.register(async (files) => {
      files.removeContentTypeParser('application/octet-stream');
      files.addContentTypeParser('application/octet-stream', (_req, payload, done) => done(null, payload));
      files.withTypeProvider<ZodTypeProvider>().put(
        '/v1/vms/:id/files',
        {
          schema: {
            tags: ['vms'],
            summary: 'Upload a file into the VM (body: the bytes, streamed; at most FILE_MAX_BYTES)',
            params,
            querystring: z.object({ path: z.string().min(1).max(4096) }),
            response: { 200: z.object({ path: z.string(), size_bytes: z.number() }), ...problemResponses },
          },
        },
        async (req, reply) => {
          const body = req.body;
          if (!isReadable(body)) {
            // Text or JSON bodies were parsed under the API's body limit.
            const data = typeof body === 'string' ? Buffer.from(body) : Buffer.from(JSON.stringify(body ?? ''));
            return deps.vms.upload(req.params.id, req.query.path, data, actorOf(req));
          }
          try {
            const declared = Number(req.headers['content-length']);
            if (Number.isFinite(declared) && declared > limits.fileMaxBytes) throw uploadTooLarge(limits.fileMaxBytes, declared);
            let seen = 0;
            // Set inside the generator, read after the upload: a field, so the compiler does not narrow it to false.
            const over = { tooLarge: false };
            const max = limits.fileMaxBytes;
            async function* capped(): AsyncGenerator<Uint8Array> {
              for await (const chunk of body as Readable) {
                seen += (chunk as Buffer).length;
                if (seen > max) {
                  over.tooLarge = true;
                  throw uploadTooLarge(max);
                }
                yield chunk as Buffer;
              }
            }
            try {
              return await deps.vms.upload(req.params.id, req.query.path, capped(), actorOf(req));
            } catch (err) {
              if (over.tooLarge) throw uploadTooLarge(max);
              throw err;
            }
          } finally {
            // A refusal before the body was read must not read the rest of it: answer, then close the connection.
            if (!req.raw.complete) void reply.header('connection', 'close');
          }
        },
      );
    });

    for (const mode of ['exec', 'attach'] as const) {
      app.route({
        method: 'GET',
        url: `/v1/vms/:id/${mode}`,
        schema: {
          tags: ['vms'],
          summary: mode === 'exec' ? 'Streaming exec (websocket)' : 'Attach a session, optionally with a TTY (websocket)',
          params,
        },
        // Refused before the upgrade, as an HTTP 429 the client's handshake sees.
        // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a hook returns a promise
        preHandler: async (req) => {
          if (!req.ws) return;
          sessions.reserve(req.caller.actor, req.params.id, req.raw.socket);
        },
        handler: () => {
          throw new AppError('WEBSOCKET_REQUIRED', 400, `${mode} streams over a websocket: connect with an Upgrade: websocket request`);
        },
        wsHandler: (socket, req) => {
          relay(socket, req as FastifyRequest<{ Params: { id: string } }>, mode, deps.vms, limits);
        },
      });
    }
  };
}

/** Websocket close codes of the relay's own refusals (the error frame before them carries the stable code). */
export const WS_CLOSE = { FRAME_QUEUE_FULL: 4008, ATTACH_IDLE_TIMEOUT: 4408, START_FRAME_TIMEOUT: 4400 } as const;
/** Above this many bytes waiting for the client, the agent's frames are not taken (and the agent's socket not read). */
export const WS_HIGH_WATER = 1024 * 1024;
/** Client frames held while the agent session opens. */
export const WS_MAX_PENDING_FRAMES = 64;
const START_FRAME_TIMEOUT_MS = 10_000;

/** Open exec/attach sessions, per caller and per caller-and-VM (keyed by caller so one tenant cannot use up another's VM). */
class SessionCounter {
  private readonly perCaller = new Map<string, number>();
  private readonly perVm = new Map<string, number>();
  constructor(private readonly limits: Pick<VmStreamLimits, 'sessionsPerVm' | 'sessionsPerTenant'>) {}

  reserve(caller: string, vmId: string, socket: { once(ev: 'close', fn: () => void): unknown }): void {
    const vmKey = `${caller}\u0000${vmId}`;
    const c = this.perCaller.get(caller) ?? 0;
    const v = this.perVm.get(vmKey) ?? 0;
    if (v >= this.limits.sessionsPerVm)
      throw new AppError(
        'TOO_MANY_SESSIONS',
        429,
        `vm ${vmId} already has ${v} open exec/attach sessions of yours (WS_MAX_SESSIONS_PER_VM=${this.limits.sessionsPerVm}); close one first`,
        { vm_id: vmId, limit: this.limits.sessionsPerVm, scope: 'vm' },
      );
    if (c >= this.limits.sessionsPerTenant)
      throw new AppError(
        'TOO_MANY_SESSIONS',
        429,
        `you already have ${c} open exec/attach sessions (WS_MAX_SESSIONS_PER_TENANT=${this.limits.sessionsPerTenant}); close one first`,
        { limit: this.limits.sessionsPerTenant, scope: 'tenant' },
      );
    this.perCaller.set(caller, c + 1);
    this.perVm.set(vmKey, v + 1);
    // The upgraded connection is this socket: its close ends the session, a failed handshake included.
    socket.once('close', () => {
      dec(this.perCaller, caller);
      dec(this.perVm, vmKey);
    });
  }
}

function dec(m: Map<string, number>, k: string): void {
  const n = (m.get(k) ?? 1) - 1;
  if (n <= 0) m.delete(k);
  else m.set(k, n);
}

function isReadable(v: unknown): v is Readable {
  return v !== null && typeof v === 'object' && typeof (v as { pipe?: unknown }).pipe === 'function';
}

function uploadTooLarge(max: number, declared?: number): AppError {
  return new AppError(
    'FILE_TOO_LARGE',
    413,
    `the upload is ${declared !== undefined ? `${declared} bytes, ` : ''}more than the ${max} bytes a transfer may move (FILE_MAX_BYTES)`,
    { max_bytes: max, ...(declared !== undefined ? { size_bytes: declared } : {}) },
  );
}

/** Resolves once `amount()` is at most `low`, or `gone()`; polled, since a websocket has no drain event of its own. */
function below(amount: () => number, low: number, gone: () => boolean): Promise<void> {
  return new Promise((resolve) => {
    const check = (): void => {
      if (amount() <= low || gone()) {
        clearInterval(timer);
        resolve();
      }
    };
    const timer = setInterval(check, 10);
    check();
  });
}

/**
 * Relays one websocket session to the VM's host agent. The first client
 * frame is the start frame; every later frame is checked before it is
 * forwarded, and agent frames come back unchanged. Both directions are
 * flow-controlled: agent frames wait while the client has more than
 * WS_HIGH_WATER bytes unread (the agent's socket is then not read, so the
 * agent stops reading the process), and the client's socket is not read
 * while the agent has not taken what was forwarded.
 */
/** binaryType 'nodebuffer' (the default): every message arrives as one Buffer. */
const text = (raw: RawData): string => (raw as Buffer).toString();

function relay(
  socket: WebSocket,
  req: FastifyRequest<{ Params: { id: string } }>,
  mode: 'exec' | 'attach',
  vms: VmCommands,
  limits: VmStreamLimits,
): void {
  const closeWith = (code: string, message: string, wsCode = 1008): void => {
    if (socket.readyState === socket.OPEN) socket.send(JSON.stringify({ type: 'error', code, message }));
    socket.close(wsCode, code);
    // A client that reads nothing never completes the closing handshake.
    setTimeout(() => socket.terminate(), 5_000).unref();
  };
  const sendError = (code: string, message: string): void => closeWith(code, message, 1008);
  let stream: AgentStream | undefined;
  let starting = false;
  let clientGone = false;
  let clientPaused = false;
  const pending: string[] = [];
  const startTimer = setTimeout(() => {
    if (!starting)
      closeWith('START_FRAME_TIMEOUT', `send the start frame within ${START_FRAME_TIMEOUT_MS} ms`, WS_CLOSE.START_FRAME_TIMEOUT);
  }, START_FRAME_TIMEOUT_MS);
  let idleTimer: NodeJS.Timeout | undefined;
  let stopActive: () => void = () => undefined;
  const touch = (): void => {
    if (mode !== 'attach' || limits.attachIdleTimeoutMs <= 0 || clientGone) return;
    clearTimeout(idleTimer);
    idleTimer = setTimeout(() => {
      req.log.info({ vm_id: req.params.id }, 'attach idle: closing');
      stream?.close();
      closeWith(
        'ATTACH_IDLE_TIMEOUT',
        `no frame in either direction for ${limits.attachIdleTimeoutMs} ms (ATTACH_IDLE_TIMEOUT_MS)`,
        WS_CLOSE.ATTACH_IDLE_TIMEOUT,
      );
    }, limits.attachIdleTimeoutMs);
  };
  touch();
  socket.on('close', () => {
    clientGone = true;
    clearTimeout(startTimer);
    clearTimeout(idleTimer);
    stopActive();
    stream?.close();
  });
  socket.on('message', (raw) => {
    touch();
    if (!stream) {
      if (pending.length >= WS_MAX_PENDING_FRAMES) {
        closeWith(
          'FRAME_QUEUE_FULL',
          `more than ${WS_MAX_PENDING_FRAMES} frames sent before the session started`,
          WS_CLOSE.FRAME_QUEUE_FULL,
        );
        return;
      }
      // Frames that arrive while the agent session opens wait behind the start frame; they must not start a second one.
      if (!starting) {
        starting = true;
        clearTimeout(startTimer);
        void start(text(raw));
      } else pending.push(text(raw));
      return;
    }
    forward(text(raw));
  });
  const forward = (text: string): void => {
    let frame: unknown;
    try {
      frame = JSON.parse(text);
    } catch {
      sendError('VALIDATION_FAILED', 'frames are JSON text');
      return;
    }
    const parsed = clientFrameSchema.safeParse(frame);
    if (!parsed.success) {
      sendError('VALIDATION_FAILED', `bad frame: ${describeFields(fieldsFromZod(parsed.error))}`);
      return;
    }
    const s = stream;
    if (!s) return;
    s.send(parsed.data);
    // The agent is not taking stdin (the process does not read it): stop reading the client until it does.
    if (!clientPaused && s.bufferedAmount() > WS_HIGH_WATER) {
      clientPaused = true;
      socket.pause();
      void below(
        () => s.bufferedAmount(),
        WS_HIGH_WATER / 4,
        () => clientGone,
      ).then(() => {
        clientPaused = false;
        if (!clientGone) socket.resume();
      });
    }
  };
  const start = async (startFrame: string): Promise<void> => {
    try {
      let first: unknown;
      try {
        first = JSON.parse(startFrame);
      } catch {
        sendError('VALIDATION_FAILED', 'the start frame must be JSON text');
        return;
      }
      const actor = actorOf(req);
      if (mode === 'exec') {
        const s = execStreamStartSchema.safeParse(first);
        if (!s.success) {
          sendError('VALIDATION_FAILED', `bad start frame: ${describeFields(fieldsFromZod(s.error))}`);
          return;
        }
        stream = await vms.execStream(req.params.id, s.data, actor);
      } else {
        const s = attachStartSchema.safeParse(first);
        if (!s.success) {
          sendError('VALIDATION_FAILED', `bad start frame: ${describeFields(fieldsFromZod(s.error))}`);
          return;
        }
        stream = await vms.attach(req.params.id, s.data, actor);
      }
      // The client left while the session opened: close it, or its process would run on unattended.
      if (clientGone) {
        stream.close();
        return;
      }
      stopActive = vms.keepActive(req.params.id, actor);
      for (const text of pending.splice(0)) forward(text);
      for await (const frame of stream.frames) {
        if (socket.readyState !== socket.OPEN) break;
        socket.send(JSON.stringify(frame));
        touch();
        if (socket.bufferedAmount > WS_HIGH_WATER)
          await below(
            () => socket.bufferedAmount,
            WS_HIGH_WATER / 4,
            () => socket.readyState !== socket.OPEN,
          );
      }
      if (socket.readyState === socket.OPEN) socket.close(1000);
    } catch (err) {
      const e = err instanceof AppError ? err : undefined;
      if (!e) req.log.error({ err }, `${mode} relay failed`);
      const p = e ? problem(e.status, e.code, e.message) : problem(500, 'INTERNAL', 'internal error');
      sendError(p.code, p.detail);
    } finally {
      clearTimeout(idleTimer);
      stopActive();
    }
  };
}
