import fastifySwagger from '@fastify/swagger';
import fastifyWebsocket from '@fastify/websocket';
import Fastify, { type FastifyBaseLogger, type FastifyInstance, type FastifyRequest } from 'fastify';
import { jsonSchemaTransform, serializerCompiler, validatorCompiler, type ZodTypeProvider } from 'fastify-type-provider-zod';
import { UnauthorizedError, ValidationError } from '@fleet/agent-protocol';
import { nulPath } from './common.js';
import { problem, errorHandler } from './problem.js';
import { bearerOf, type ApiKeys } from './auth.js';
import { safeEqual } from '../crypto.js';
import type { Metrics } from './metrics.js';
import { withTimeout } from '../timeout.js';
import { E2B_PREFIX } from './e2b/e2b-auth.js';

export interface Readiness {
  /** Name → check; each resolves when its dependency answers. */
  readonly checks: Record<string, () => Promise<void>>;
}

export interface AppOptions {
  /** A pino logger, or false for silence (tests). */
  readonly logger: FastifyBaseLogger | false;
  readonly apiKeys: ApiKeys;
  readonly metrics: Metrics;
  readonly readiness: Readiness;
  /** Route plugins, registered after auth and the documentation are in place. */
  readonly routes: ReadonlyArray<(app: FastifyInstance) => Promise<void> | void>;
  /** JSON and text bodies (default 1 MiB); a route may raise its own (POST /v1/vms does). */
  readonly bodyLimit?: number;
  /** When set, /metrics needs it as a bearer token, and it (like the admin key) sees /readyz's details. */
  readonly metricsToken?: string | undefined;
}

export const DEFAULT_BODY_LIMIT = 1024 * 1024;

/** A client's X-Request-Id becomes the correlation id of every event it causes: only short, plain ones are kept. */
const REQUEST_ID = /^[A-Za-z0-9._:-]{1,128}$/;

const PUBLIC = new Set(['/healthz', '/readyz', '/metrics', '/openapi.json']);

/** The API as a plugin-built app (fastify/demo style): process concerns live in main.ts. */
export async function buildApp(opts: AppOptions): Promise<FastifyInstance> {
  const app = Fastify({
    ...(opts.logger ? { loggerInstance: opts.logger } : { logger: false }),
    bodyLimit: opts.bodyLimit ?? DEFAULT_BODY_LIMIT,
    // Request ids double as correlation ids in event metadata; anything else than a short plain id is replaced.
    requestIdHeader: false,
    genReqId: (req) => {
      const given = req.headers['x-request-id'];
      return typeof given === 'string' && REQUEST_ID.test(given) ? given : crypto.randomUUID();
    },
  }).withTypeProvider<ZodTypeProvider>();
  const isMetricsToken = (req: FastifyRequest): boolean => {
    const token = bearerOf(req);
    return token !== undefined && opts.metricsToken !== undefined && safeEqual(token, opts.metricsToken);
  };
  const isAdmin = (req: FastifyRequest): boolean => {
    const token = bearerOf(req);
    return token !== undefined && opts.apiKeys.isAdminToken(token);
  };

  app.setValidatorCompiler(validatorCompiler);
  app.setSerializerCompiler(serializerCompiler);
  app.setErrorHandler(errorHandler);
  // Unknown routes get the same problem shape as everything else.
  app.setNotFoundHandler((req, reply) => {
    void reply
      .status(404)
      .type('application/problem+json')
      .send(problem(404, 'ROUTE_NOT_FOUND', `no route ${req.method} ${req.url.split('?')[0]}`));
  });
  // Any body type fastify does not parse itself arrives as a Buffer (file uploads).
  app.addContentTypeParser('application/octet-stream', { parseAs: 'buffer' }, (_req, body, done) => done(null, body));

  await app.register(fastifySwagger, {
    openapi: {
      openapi: '3.0.3',
      info: {
        title: 'Fleet control plane',
        description: 'Place, boot, exec into, snapshot and destroy sandboxes on a fleet of hosts.',
        version: '1.0.0',
      },
      components: { securitySchemes: { bearer: { type: 'http', scheme: 'bearer' } } },
      security: [{ bearer: [] }],
    },
    transform: jsonSchemaTransform,
  });
  // One client frame at most 1 MiB: the relay holds up to WS_MAX_PENDING_FRAMES of them before a session starts.
  await app.register(fastifyWebsocket, { options: { maxPayload: 1024 * 1024 } });

  // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a hook returns a promise
  app.addHook('onRequest', async (req) => {
    const path = req.url.replace(/\?.*/s, '');
    // The E2B-compatible API authenticates in its own scope (X-API-Key; envd by the sandbox's access token).
    if (PUBLIC.has(path) || path.startsWith(`${E2B_PREFIX}/`)) return;
    req.caller = opts.apiKeys.authenticate(req);
  });
  // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a hook returns a promise
  app.addHook('preValidation', async (req) => {
    // A raw body (a file upload as text or bytes) may hold any byte; parsed JSON, params and the query may not.
    // A guest file path is the exception: the files routes refuse it with their own code (INVALID_GUEST_PATH).
    const body = typeof req.body === 'object' && !isStream(req.body) ? req.body : undefined;
    const { path: _guestPath, ...rest } = (req.query ?? {}) as Record<string, unknown>;
    const query = req.routeOptions.url?.endsWith('/files') ? rest : req.query;
    const where = nulPath(req.params, 'params') ?? nulPath(query, 'querystring') ?? nulPath(body, 'body');
    if (where)
      throw new ValidationError(`${where} contains a NUL character (U+0000): remove it`, [
        { path: where, message: 'contains a NUL character' },
      ]);
  });
  app.addHook('onResponse', async (req, reply) => {
    const route = req.routeOptions.url ?? 'unmatched';
    opts.metrics.httpRequests.inc({ method: req.method, route, status: String(reply.statusCode) });
    opts.metrics.httpDuration.observe({ method: req.method, route }, reply.elapsedTime / 1000);
  });

  app.get('/healthz', { schema: { hide: true } }, () => ({ status: 'ok' }));
  app.get('/readyz', { schema: { hide: true } }, async (req, reply) => {
    const results: Record<string, string> = {};
    const failed: string[] = [];
    await Promise.all(
      Object.entries(opts.readiness.checks).map(async ([name, check]) => {
        try {
          await withTimeout(check(), 2000);
          results[name] = 'ok';
        } catch (err) {
          failed.push(name);
          results[name] = err instanceof Error ? err.message : String(err);
        }
      }),
    );
    const ready = failed.length === 0;
    const status = ready ? 'ready' : 'not ready';
    // Error text names hosts, ports and internals: only for the operator (admin key or METRICS_TOKEN).
    const detailed = isAdmin(req) || isMetricsToken(req);
    return reply.status(ready ? 200 : 503).send(detailed ? { status, checks: results } : { status });
  });
  app.get('/metrics', { schema: { hide: true } }, async (req, reply) => {
    if (opts.metricsToken !== undefined && !isMetricsToken(req)) {
      throw new UnauthorizedError('/metrics needs "Authorization: Bearer <METRICS_TOKEN>"');
    }
    const body = await opts.metrics.registry.metrics();
    return reply.type(opts.metrics.registry.contentType).send(body);
  });
  app.get('/openapi.json', { schema: { hide: true } }, () => app.swagger());

  for (const routes of opts.routes) await app.register(async (scope) => routes(scope));
  await app.ready();
  return app;
}

function isStream(v: unknown): boolean {
  return v !== null && typeof v === 'object' && typeof (v as { pipe?: unknown }).pipe === 'function';
}
