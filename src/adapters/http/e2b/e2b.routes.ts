import type { FastifyError, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { hasZodFastifySchemaValidationErrors, type ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import { AppError, NotFoundError, UnauthorizedError, ValidationError } from '@fleet/agent-protocol';
import type { Actor, VmCommands } from '../../../commands/vm/vm-commands.js';
import type { VmLifecycle } from '../../../commands/vm/vm-lifecycle.js';
import type { Position } from '../../../domain/event-store.port.js';
import type { ExistingVmState } from '../../../domain/vm/vm.decider.js';
import { metadataSchema } from '../../../domain/vm/vm.lifecycle.js';
import { parseVmSpec } from '../../../domain/vm/spec.js';
import type { ProjectionRunner } from '../../../projections/runner.js';
import { getSnapshot } from '../../../projections/snapshots/snapshots.queries.js';
import { listVms, type VmRow } from '../../../projections/vms/vms.queries.js';
import type { ApiKeys } from '../auth.js';
import { cursorTime, decodeCursor, encodeCursor } from '../pagination.js';
import { E2B_PREFIX, ENVD_VERSION, type EnvdTokens } from './e2b-auth.js';

/**
 * The E2B REST API (what the stock `e2b` SDK calls with E2B_API_URL set to
 * `<api>/e2b`), as thin translations onto VmCommands and the `vms` read
 * model: a sandbox is a VM, every action is the VM's own event. Answers and
 * errors are in E2B's shapes (`{code, message}`), since the SDK reads them:
 * 401 → AuthenticationError, 404 → SandboxNotFoundError, 429 →
 * RateLimitError, 503 → ServiceBusyError. What is not built yet (pause,
 * resume, fork, snapshots, metrics, network) answers 501 saying why, never
 * a pretend success.
 */

/** E2B's default sandbox timeout when a create names none (its API's documented default). */
export const DEFAULT_TIMEOUT_S = 300;
const MAX_TIMEOUT_S = 30 * 24 * 3600;
/** endAt of a VM without a deadline (one made through /v1 without max_runtime_s): E2B's schema requires a time. */
const NO_END = '9999-12-31T23:59:59.000Z';
/** Our states E2B calls `running`: a create answers once the VM runs, so the earlier ones are only brief. */
const RUNNING_STATES = ['requested', 'placed', 'booting', 'running'] as const;

export interface E2bRoutesDeps {
  readonly apiKeys: ApiKeys;
  readonly vms: VmCommands;
  /** E2B's timeout and metadata are the VM lifecycle's own (timeout_at, metadata): the same command PATCH /v1/vms/:id uses. */
  readonly lifecycle: VmLifecycle;
  readonly pool: Pool;
  readonly runner: ProjectionRunner;
  readonly tokens: EnvdTokens;
  readonly readYourWritesTimeoutMs: number;
}

const timeoutSchema = z.number().int().min(1).max(MAX_TIMEOUT_S);
const envVarsSchema = z.record(z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/, 'an environment variable name'), z.string());

const newSandboxFields = {
  templateID: z.string().min(1).max(256),
  timeout: timeoutSchema.optional(),
  metadata: metadataSchema.optional(),
  envVars: envVarsSchema.optional(),
  allow_internet_access: z.boolean().optional(),
  autoPause: z.boolean().optional(),
  autoPauseMemory: z.boolean().optional(),
  autoResume: z.object({ enabled: z.boolean() }).optional(),
  network: z.record(z.string(), z.unknown()).optional(),
  mcp: z.record(z.string(), z.unknown()).nullable().optional(),
  iam: z.record(z.string(), z.unknown()).optional(),
  volumeMounts: z.array(z.unknown()).optional(),
};
const newSandboxV2Schema = z.object(newSandboxFields);
const newSandboxV1Schema = z.object({ ...newSandboxFields, secure: z.boolean().optional() });
type NewSandbox = z.infer<typeof newSandboxV1Schema>;

const params = z.object({ sandboxID: z.string().min(1).max(64) });
const sandboxQuery = z.object({
  metadata: z
    .string()
    .max(16 * 1024)
    .optional(),
  state: z.union([z.string(), z.array(z.string())]).optional(),
  limit: z.coerce.number().int().min(1).max(100).default(100),
  nextToken: z.string().max(512).optional(),
  order: z.enum(['asc', 'desc']).optional(),
  startedAfter: z.iso.datetime({ offset: true }).optional(),
  template: z.string().max(256).optional(),
});

export function e2bRoutes(deps: E2bRoutesDeps) {
  return async (root: FastifyInstance): Promise<void> => {
    await root.register(
      (scope, _opts, done) => {
        const app = scope.withTypeProvider<ZodTypeProvider>();
        // Read-your-writes per tenant on this replica: a list right after a create sees it.
        const lastPosition = new Map<string, Position>();
        const remember = (actor: Actor, position: Position | undefined): void => {
          if (position !== undefined) lastPosition.set(actor.tenantId, position);
        };

        app.addHook('onRequest', (req, _reply, next) => {
          try {
            const key = req.headers['x-api-key'];
            if (typeof key !== 'string' || key === '')
              throw new UnauthorizedError('missing X-API-Key header: set E2B_API_KEY to a tenant key');
            req.caller = deps.apiKeys.authenticateKey(key);
            next();
          } catch (err) {
            next(err as Error);
          }
        });
        app.setErrorHandler(e2bErrorHandler);
        app.setNotFoundHandler((req, reply) => {
          void reply
            .status(404)
            .send({ code: 404, message: `no E2B route ${req.method} ${req.url.split('?')[0]}`, error_code: 'ROUTE_NOT_FOUND' });
        });

        const actorOf = (req: FastifyRequest): Actor => ({
          correlationId: req.id,
          tenantId: req.caller.tenantId,
          actor: `${req.caller.actor} (e2b)`,
          admin: req.caller.admin,
        });

        /** A sandbox E2B would still know: our VM, not ended. Anything else is E2B's 404 (SandboxNotFoundError). */
        const live = async (id: string, actor: Actor): Promise<ExistingVmState> => {
          const vm = await deps.vms.get(id, actor).catch((err: unknown) => {
            if (err instanceof AppError && err.status === 404) throw sandboxNotFound(id);
            throw err;
          });
          if (!(RUNNING_STATES as readonly string[]).includes(vm.status)) throw sandboxNotFound(id);
          return vm;
        };

        const sandboxAnswer = (vm: ExistingVmState) => ({
          sandboxID: vm.vm_id,
          templateID: templateOf(vm.spec),
          clientID: 'fleet',
          envdVersion: ENVD_VERSION,
          envdAccessToken: deps.tokens.tokenFor(vm.vm_id),
          domain: null,
        });

        const create = async (body: NewSandbox, req: FastifyRequest, reply: FastifyReply) => {
          refuseUnsupported(body);
          const actor = actorOf(req);
          const snapshot = await getSnapshot(deps.pool, body.templateID, req.caller.admin ? undefined : req.caller.tenantId);
          const spec = {
            ...(snapshot && snapshot.state === 'ready' ? { seed_snapshot_id: body.templateID } : { image: body.templateID }),
            ...(body.metadata && Object.keys(body.metadata).length > 0 ? { metadata: body.metadata } : {}),
            ...(body.envVars && Object.keys(body.envVars).length > 0 ? { secrets: body.envVars } : {}),
            egress: egressOf(body),
            // The sandbox's timeout is the VM's max runtime: its deadline (timeout_at) is set as it boots, in the same stream.
            max_runtime_s: body.timeout ?? DEFAULT_TIMEOUT_S,
          };
          const created = await deps.vms.create(parseVmSpec(spec), actor);
          remember(actor, created.position);
          return reply.status(201).send(sandboxAnswer(created.vm));
        };

        app.post('/v2/sandboxes', { schema: { hide: true, body: newSandboxV2Schema } }, async (req, reply) => create(req.body, req, reply));
        app.post('/sandboxes', { schema: { hide: true, body: newSandboxV1Schema } }, async (req, reply) => create(req.body, req, reply));

        app.get('/sandboxes/:sandboxID', { schema: { hide: true, params } }, async (req) => {
          const vm = await live(req.params.sandboxID, actorOf(req));
          return {
            ...listedFromState(vm),
            envdAccessToken: deps.tokens.tokenFor(vm.vm_id),
            domain: null,
            allowInternetAccess: (vm.spec.egress?.mode ?? 'direct') !== 'none',
            lifecycle: { onTimeout: 'kill', autoResume: false },
          };
        });

        app.delete('/sandboxes/:sandboxID', { schema: { hide: true, params } }, async (req, reply) => {
          const actor = actorOf(req);
          await live(req.params.sandboxID, actor);
          const r = await deps.vms.destroy(req.params.sandboxID, actor);
          remember(actor, r.position);
          return reply.status(204).send();
        });

        const list = async (req: FastifyRequest, q: z.infer<typeof sandboxQuery>, reply: FastifyReply, onlyRunning: boolean) => {
          const actor = actorOf(req);
          const pending = lastPosition.get(actor.tenantId);
          if (pending !== undefined) await deps.runner.waitFor(pending, deps.readYourWritesTimeoutMs);
          if (q.order === 'asc')
            throw new ValidationError('order=asc is not supported: sandboxes are listed newest first', [
              { path: 'querystring.order', message: 'only desc' },
            ]);
          const wanted = (Array.isArray(q.state) ? q.state : (q.state?.split(',') ?? [])).filter(Boolean);
          for (const s of wanted)
            if (s !== 'running' && s !== 'paused')
              throw new ValidationError(`state "${s}" is not one of running, paused`, [
                { path: 'querystring.state', message: 'running or paused' },
              ]);
          // No sandbox is ever paused until memory state (issue 16) lands.
          const states = onlyRunning || wanted.length === 0 || wanted.includes('running') ? [...RUNNING_STATES] : [];
          if (states.length === 0) return reply.send([]);
          const after = decodeCursor(q.nextToken, z.object({ created_at: cursorTime, id: z.string() }));
          const rows = await listVms(deps.pool, {
            tenantId: req.caller.admin ? undefined : req.caller.tenantId,
            states,
            metadata: parseMetadataQuery(q.metadata),
            createdAfter: q.startedAfter,
            template: q.template,
            limit: q.limit,
            after,
          });
          const last = rows.at(-1);
          if (rows.length === q.limit && last)
            void reply.header('x-next-token', encodeCursor({ created_at: last.created_at, id: last.id }));
          return reply.send(rows.map(listedFromRow));
        };
        app.get('/v2/sandboxes', { schema: { hide: true, querystring: sandboxQuery } }, async (req, reply) =>
          list(req, req.query, reply, false),
        );
        app.get('/sandboxes', { schema: { hide: true, querystring: sandboxQuery } }, async (req, reply) =>
          list(req, req.query, reply, true),
        );

        app.post(
          '/sandboxes/:sandboxID/timeout',
          { schema: { hide: true, params, body: z.object({ timeout: timeoutSchema }) } },
          async (req, reply) => {
            const actor = actorOf(req);
            await live(req.params.sandboxID, actor);
            const r = await deps.lifecycle.update(req.params.sandboxID, { timeout_s: req.body.timeout }, actor);
            remember(actor, r.position);
            return reply.status(204).send();
          },
        );

        const connectBody = z.object({ timeout: timeoutSchema.optional(), memory: z.boolean().optional() }).optional();
        const connect = async (req: FastifyRequest, id: string, timeout: number | undefined, reply: FastifyReply) => {
          const actor = actorOf(req);
          let vm = await live(id, actor);
          // E2B: connecting only ever extends the sandbox's life.
          const timeoutS = timeout ?? DEFAULT_TIMEOUT_S;
          if (vm.status === 'running' && vm.timeout_at !== undefined && Date.parse(vm.timeout_at) < Date.now() + timeoutS * 1000) {
            const r = await deps.lifecycle.update(vm.vm_id, { timeout_s: timeoutS }, actor);
            remember(actor, r.position);
            vm = r.vm;
          }
          return reply.status(200).send(sandboxAnswer(vm));
        };
        app.post('/v2/sandboxes/:sandboxID/connect', { schema: { hide: true, params, body: connectBody } }, async (req, reply) =>
          connect(req, req.params.sandboxID, req.body?.timeout, reply),
        );
        app.post('/sandboxes/:sandboxID/connect', { schema: { hide: true, params, body: connectBody } }, async (req, reply) =>
          connect(req, req.params.sandboxID, req.body?.timeout, reply),
        );

        const notYet = (what: string, needs: string) => async (req: FastifyRequest<{ Params: { sandboxID?: string } }>) => {
          if (req.params.sandboxID !== undefined) await live(req.params.sandboxID, actorOf(req));
          throw new AppError('E2B_NOT_SUPPORTED', 501, `${what} is not supported by this control plane yet: it needs ${needs}`);
        };
        const memory = 'memory state (CRIU, issue 16)';
        app.post('/sandboxes/:sandboxID/pause', { schema: { hide: true, params } }, notYet('pause', memory));
        app.post('/sandboxes/:sandboxID/resume', { schema: { hide: true, params } }, notYet('resume', memory));
        app.post('/sandboxes/:sandboxID/fork', { schema: { hide: true, params } }, notYet('fork of a running sandbox', memory));
        app.post('/sandboxes/:sandboxID/snapshots', { schema: { hide: true, params } }, notYet('createSnapshot', memory));
        app.get('/snapshots', { schema: { hide: true } }, notYet('listing snapshots', memory));
        app.put('/sandboxes/:sandboxID/network', { schema: { hide: true, params } }, notYet('updateNetwork', 'egress policy (issue 17)'));
        app.get(
          '/sandboxes/:sandboxID/metrics',
          { schema: { hide: true, params } },
          notYet('getMetrics', 'per-sandbox usage readings from the host agent'),
        );
        done();
      },
      { prefix: E2B_PREFIX },
    );
  };
}

function sandboxNotFound(id: string): AppError {
  return new NotFoundError('SANDBOX_NOT_FOUND', `sandbox ${id} not found`, { sandbox_id: id });
}

/** Fields we cannot honour yet are refused (400), never accepted and dropped. */
function refuseUnsupported(b: NewSandbox): void {
  const refuse = (field: string, why: string): never => {
    throw new ValidationError(`${field}: ${why}`, [{ path: `body.${field}`, message: why }], 'E2B_NOT_SUPPORTED');
  };
  if (b.secure === false) refuse('secure', 'every sandbox here needs its envd access token; send true or nothing');
  // Only allowOut/denyOut map onto our egress policy; the rest of E2B's network options have no counterpart here.
  for (const key of Object.keys(b.network ?? {})) {
    if (key !== 'allowOut' && key !== 'denyOut')
      refuse(`network.${key}`, 'only allowOut and denyOut are supported (docs/e2b-compatibility.md)');
  }
  if (b.autoPause === true || b.autoPauseMemory !== undefined) refuse('autoPause', 'pausing needs memory state (CRIU, issue 16)');
  if (b.autoResume?.enabled === true) refuse('autoResume', 'resuming needs memory state (CRIU, issue 16)');
  if (b.mcp !== undefined && b.mcp !== null) refuse('mcp', 'the MCP gateway is not provided');
  if (b.iam !== undefined) refuse('iam', 'workload identity is not provided');
  if (b.volumeMounts !== undefined && b.volumeMounts.length > 0) refuse('volumeMounts', 'volumes are not provided');
}

const stringList = z.array(z.string().min(1).max(253)).max(256);

/**
 * E2B's internet switch and allow/deny lists as our egress policy: no internet is mode `none`; otherwise `direct`
 * with the lists (domain names there are refused by the egress validation, as our direct mode enforces only
 * addresses: EGRESS_DOMAIN_RULES_NEED_PROXY).
 */
function egressOf(b: NewSandbox): { mode: 'direct' | 'none'; allow_out?: string[]; deny_out?: string[] } {
  const parse = (field: 'allowOut' | 'denyOut'): string[] | undefined => {
    const v = b.network?.[field];
    if (v === undefined) return undefined;
    const r = stringList.safeParse(v);
    if (!r.success)
      throw new ValidationError(`network.${field}: a list of addresses or CIDRs`, [
        { path: `body.network.${field}`, message: 'a list of addresses or CIDRs' },
      ]);
    return r.data;
  };
  const allow = parse('allowOut');
  const deny = parse('denyOut');
  if (b.allow_internet_access === false) {
    if (allow || deny)
      throw new ValidationError('network: allowOut/denyOut need internet access', [
        { path: 'body.network', message: 'allowOut/denyOut need allow_internet_access' },
      ]);
    return { mode: 'none' };
  }
  return { mode: 'direct', ...(allow ? { allow_out: allow } : {}), ...(deny ? { deny_out: deny } : {}) };
}

function templateOf(spec: { image?: string | undefined; seed_snapshot_id?: string | undefined }): string {
  return spec.image ?? spec.seed_snapshot_id ?? 'base';
}

function resources(spec: { cpus: number; ram_mb: number; storage_gb: number }) {
  return { cpuCount: spec.cpus, memoryMB: spec.ram_mb, diskSizeMB: spec.storage_gb * 1024 };
}

function listedFromState(vm: ExistingVmState) {
  return {
    sandboxID: vm.vm_id,
    templateID: templateOf(vm.spec),
    clientID: 'fleet',
    ...resources(vm.spec),
    startedAt: vm.requested_at,
    endAt: vm.timeout_at ?? NO_END,
    envdVersion: ENVD_VERSION,
    metadata: vm.metadata,
    state: 'running' as const,
  };
}

function listedFromRow(r: VmRow) {
  const spec = r.spec as {
    cpus?: number;
    ram_mb?: number;
    storage_gb?: number;
    image?: string;
    seed_snapshot_id?: string;
  };
  return {
    sandboxID: r.id,
    templateID: templateOf(spec),
    clientID: 'fleet',
    ...resources({ cpus: spec.cpus ?? 1, ram_mb: spec.ram_mb ?? 0, storage_gb: spec.storage_gb ?? 0 }),
    startedAt: r.created_at,
    endAt: r.timeout_at ?? NO_END,
    envdVersion: ENVD_VERSION,
    metadata: r.metadata,
    state: 'running' as const,
  };
}

/**
 * The SDK sends `metadata` as a query string of its own whose keys and values
 * it encoded once more ("user%3Dabc%26app%3Dprod" after the outer decoding).
 */
export function parseMetadataQuery(raw: string | undefined): Record<string, string> | undefined {
  if (!raw) return undefined;
  const out: Record<string, string> = {};
  try {
    for (const [k, v] of new URLSearchParams(raw)) out[decodeURIComponent(k)] = decodeURIComponent(v);
  } catch {
    throw new ValidationError('metadata must be a URL-encoded query string ("key=value&key2=value2")', [
      { path: 'querystring.metadata', message: 'malformed' },
    ]);
  }
  return Object.keys(out).length > 0 ? out : undefined;
}

/** E2B's error shape; our stable code rides along as E2B's `error_code`. A 5xx never tells its insides. */
export function e2bErrorHandler(err: FastifyError | Error, req: FastifyRequest, reply: FastifyReply): void {
  const send = (status: number, message: string, code: string): void => {
    void reply.status(status).type('application/json').send({ code: status, message, error_code: code });
  };
  if (hasZodFastifySchemaValidationErrors(err)) {
    const where = (err as FastifyError).validationContext ?? 'request';
    send(
      400,
      `invalid ${where}: ${err.validation.map((v) => `${where}${v.instancePath.replace(/\//g, '.')}: ${v.message ?? 'invalid'}`).join('; ')}`,
      'VALIDATION_FAILED',
    );
    return;
  }
  if (err instanceof AppError) {
    // No room anywhere is E2B's 503 (ServiceBusyError: nothing changed, retry later), not our 409.
    const status = err.code === 'CAPACITY_EXHAUSTED' ? 503 : err.status;
    if (status >= 500) req.log.warn({ err: { code: err.code, message: err.message } }, 'e2b request failed');
    send(status, err.message, err.code);
    return;
  }
  const fe = err as FastifyError;
  if (typeof fe.statusCode === 'number' && fe.statusCode >= 400 && fe.statusCode < 500) {
    send(fe.statusCode, fe.message, fe.code ? fe.code.replace(/^FST_ERR_/, '') : 'BAD_REQUEST');
    return;
  }
  req.log.error({ err }, 'unhandled error in the e2b api');
  send(500, 'internal error', 'INTERNAL');
}
