import type { IncomingMessage } from 'node:http';
import type { FastifyInstance } from 'fastify';
import { z } from 'zod';
import { Readable } from 'node:stream';
import {
  AGENT_API_PREFIX,
  execRequestSchema,
  execResultSchema,
  filePathQuerySchema,
  uploadResponseSchema,
  vmNameSchema,
} from '@fleet/agent-protocol';
import { AppError, ValidationError } from '@fleet/agent-protocol';
import { effectiveTimeout, runBuffered, runSession } from '../exec.js';
import { type AgentRouteContext } from './context.js';
import { bodyOf, paramOf, part, queryOf, sandboxName, type Answer, type RouteSchema } from './route-schema.js';

/** A download's path, and `max_bytes`: the caller's cap, checked against the file's size before any byte moves. */
const downloadQuerySchema = filePathQuerySchema.extend({ max_bytes: z.coerce.number().int().nonnegative().optional() });

/** Each route's request parts and responses (route-schema.ts). The websocket exec/attach frames are the protocol's client and server frames. */
export const schemas = {
  exec: { params: { name: sandboxName }, body: part(execRequestSchema, 'exec request'), response: { 200: execResultSchema } },
  /** The body is the file's raw bytes (application/octet-stream). */
  upload: { params: { name: sandboxName }, querystring: part(filePathQuerySchema, 'query'), response: { 200: uploadResponseSchema } },
  /** application/octet-stream; `max_bytes` refuses a larger file (413) before a byte moves. */
  download: {
    params: { name: sandboxName },
    querystring: part(downloadQuerySchema, 'query'),
    response: { 200: z.instanceof(Readable) },
  },
} satisfies Record<string, RouteSchema>;

/** Inside a sandbox: buffered exec, exec/attach over websockets, file upload and download. */
export function registerExecRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend, config, limits } = ctx;
  // ---- exec -------------------------------------------------------------------
  app.post(`${AGENT_API_PREFIX}/vms/:name/exec`, async (req, reply) => {
    const name = paramOf(req, schemas.exec.params, 'name');
    const body = bodyOf(req, schemas.exec.body);
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
      url: `${AGENT_API_PREFIX}/vms/:name/${mode}`,
      handler: () => {
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
  app.put(`${AGENT_API_PREFIX}/vms/:name/files`, async (req): Promise<Answer<typeof schemas.upload, 200>> => {
    const name = paramOf(req, schemas.upload.params, 'name');
    // Any other content type arrives parsed, not as a stream.
    const body = req.body as Partial<IncomingMessage> | undefined;
    try {
      const q = queryOf(req, schemas.upload.querystring);
      if (!body || typeof (body as { pipe?: unknown }).pipe !== 'function') {
        throw new AppError('UNSUPPORTED_MEDIA_TYPE', 415, 'send the file as the raw body with Content-Type: application/octet-stream');
      }
      // Written from inside the sandbox: a guest racing to swap a path component for a symlink cannot redirect it.
      const written = await backend.writeGuestFile(name, q.path, body as IncomingMessage, {
        maxBytes: config.maxUploadBytes,
        ...(q.mode ? { mode: parseInt(q.mode, 8) } : {}),
      });
      const size = written.bytes;
      return { path: q.path, size_bytes: size };
    } finally {
      // An early refusal must not leave the client blocked on an unread body.
      body?.resume?.();
    }
  });

  app.get(`${AGENT_API_PREFIX}/vms/:name/files`, async (req, reply) => {
    const name = paramOf(req, schemas.download.params, 'name');
    const q = queryOf(req, schemas.download.querystring);
    const maxBytes = q.max_bytes;
    const file = await backend.readGuestFile(name, q.path);
    // The size is known before a byte is read: a file over the caller's cap is refused, and its reader stopped.
    if (maxBytes !== undefined && file.size > maxBytes) {
      file.stream.destroy();
      file.done.catch(() => undefined);
      throw new AppError('FILE_TOO_LARGE', 413, `"${file.path}" is ${file.size} bytes, more than the ${maxBytes} bytes asked for`, {
        size_bytes: file.size,
        max_bytes: maxBytes,
      });
    }
    file.done.catch((err: unknown) => req.log.warn({ err: { message: (err as Error).message }, path: q.path }, 'download failed part-way'));
    return reply.type('application/octet-stream').header('content-length', file.size).send(file.stream);
  });
}
