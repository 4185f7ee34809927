import { createHash, timingSafeEqual } from 'node:crypto';
import websocket from '@fastify/websocket';
import Fastify, { type FastifyBaseLogger, type FastifyInstance } from 'fastify';
import { AppError, UnauthorizedError } from '@fleet/agent-protocol';
import type { Backend } from './backend.js';
import { runBuffered, type ExecLimits } from './exec.js';
import { GuestAgentStore } from './guest-agents.js';
import type { AgentAppConfig, AgentRouteContext } from './routes/context.js';
import { registerCheckpointRoutes } from './routes/checkpoints.routes.js';
import { registerEnvdRoutes } from './routes/envd.routes.js';
import { registerExecRoutes } from './routes/exec.routes.js';
import { registerHostRoutes } from './routes/host.routes.js';
import { registerVmRoutes } from './routes/vms.routes.js';
import { registerObserveRoutes } from './routes/observe.routes.js';
import { registerEgressRoutes } from './routes/egress.routes.js';
import { registerMemoryRoutes } from './routes/memory.routes.js';
import { registerMigrationRoutes } from './routes/migration.routes.js';
import { registerLazyRoutes } from './routes/lazy.routes.js';

export type { AgentAppConfig } from './routes/context.js';

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

  // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a hook returns a promise
  app.addHook('onRequest', async (req) => {
    // Not-found requests have no route config.
    const auth = (req.routeOptions.config as { auth?: string } | undefined)?.auth;
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

  app.get('/healthz', { config: { auth: 'none' } }, () => ({ ok: true, version: deps.version ?? '0' }));

  const checkedRun = async (name: string, argv: string[], what: string, env: Record<string, string> = {}): Promise<string> => {
    const res = await runBuffered(
      backend,
      name,
      { argv, env, timeoutMs: limits.defaultTimeoutMs, encoding: 'utf8' },
      64 * 1024,
      new AbortController().signal,
    );
    if (res.exit_code !== 0 || res.timed_out) {
      throw new AppError(
        'AGENT_START_FAILED',
        422,
        `could not ${what} in the sandbox (exit ${res.exit_code}${res.timed_out ? ', timed out' : ''}): ${res.stderr.slice(0, 500)}`,
      );
    }
    return res.stdout;
  };
  const ctx: AgentRouteContext = { backend, config, limits, guestAgents, activePulls, now, checkedRun };
  registerHostRoutes(app, ctx);
  registerVmRoutes(app, ctx);
  registerExecRoutes(app, ctx);
  registerCheckpointRoutes(app, ctx);
  registerObserveRoutes(app, ctx);
  registerEgressRoutes(app, ctx);
  registerMemoryRoutes(app, ctx);
  registerMigrationRoutes(app, ctx);
  registerLazyRoutes(app, ctx);
  registerEnvdRoutes(app, ctx);

  return app;
}

function sha256(b: Buffer): Buffer {
  return createHash('sha256').update(b).digest();
}

/** Maps anything thrown to `{code, message, details?}`; a 5xx never leaks an unexpected error's message. */
export function toProblem(err: unknown): { status: number; body: { code: string; message: string; details?: Record<string, unknown> } } {
  if (err instanceof AppError) {
    const body = { code: err.code, message: err.message, ...(err.details ? { details: { ...err.details } } : {}) };
    return { status: err.status, body };
  }
  const e = err as { code?: string; statusCode?: number; message?: string } | null | undefined;
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
