import type { FastifyInstance } from 'fastify';
import {
  AGENT_API_PREFIX,
  AppError,
  completeMigrationRequestSchema,
  incomingMigrationRequestSchema,
  sendMigrationRequestSchema,
  type AbortedMigration,
  type IncomingMigration,
  type MigrationOffer,
  type MigrationReport,
} from '@fleet/agent-protocol';
import type { Backend } from '../backend.js';
import { parse } from '../parse.js';
import { nameParam, toVmInfo, type AgentRouteContext } from './context.js';

const unsupported = (backend: Backend): AppError =>
  new AppError('BACKEND_UNSUPPORTED', 409, `the ${backend.kind} backend has no native live migration (move a paused checkpoint instead)`, {
    backend: backend.kind,
  });

/** Native live migration between two agents (backend.ts sendMigration; protocol: agent-protocol migration.ts). */
export function registerMigrationRoutes(app: FastifyInstance, ctx: AgentRouteContext): void {
  const { backend } = ctx;
  app.get(`${AGENT_API_PREFIX}/vms/:name/migration/offer`, async (req): Promise<MigrationOffer> => {
    const name = nameParam(req);
    if (!backend.migrationOffer) throw unsupported(backend);
    return { name, machine: await backend.migrationOffer(name) };
  });

  app.post(`${AGENT_API_PREFIX}/migrations/incoming`, async (req, reply) => {
    const body = parse(incomingMigrationRequestSchema, req.body, 'incoming migration');
    if (!backend.prepareIncoming) throw unsupported(backend);
    const vm = body.vm;
    const target = await backend.prepareIncoming(
      {
        name: vm.name,
        cpus: vm.cpus,
        ram_mb: vm.ram_mb,
        storage_gb: vm.storage_gb,
        tenant: vm.tenant,
        env: vm.env,
        expose: vm.expose,
        ...(vm.image ? { image: vm.image } : {}),
        ...(vm.checkpoint_id ? { checkpointId: vm.checkpoint_id } : {}),
        ...(vm.resume ? { resume: true } : {}),
        ...(vm.ip_hint ? { ipHint: vm.ip_hint } : {}),
        ...(vm.net_raw ? { net_raw: true } : {}),
        ...(vm.egress ? { egress: vm.egress } : {}),
      },
      body.machine,
      { ttlMs: body.ttl_s * 1000, lazy: body.lazy },
    );
    const res: IncomingMigration = { name: vm.name, ...target };
    return reply.code(201).send(res);
  });

  app.delete(`${AGENT_API_PREFIX}/migrations/incoming/:name`, async (req): Promise<AbortedMigration> => {
    const name = nameParam(req);
    if (!backend.abortIncoming) throw unsupported(backend);
    return { name, aborted: await backend.abortIncoming(name) };
  });

  app.post(`${AGENT_API_PREFIX}/vms/:name/migration/send`, async (req): Promise<MigrationReport> => {
    const name = nameParam(req);
    const body = parse(sendMigrationRequestSchema, req.body, 'migration send');
    if (!backend.sendMigration) throw unsupported(backend);
    return backend.sendMigration(name, body.to, { lazy: body.lazy });
  });

  app.post(`${AGENT_API_PREFIX}/vms/:name/migration/complete`, async (req) => {
    const name = nameParam(req);
    const body = parse(completeMigrationRequestSchema, req.body ?? {}, 'migration complete');
    if (!backend.completeIncoming) throw unsupported(backend);
    return toVmInfo(await backend.completeIncoming(name, { keepPaused: body.keep_paused }));
  });
}
