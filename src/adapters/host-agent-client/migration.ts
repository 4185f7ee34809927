import type { z } from 'zod';
import {
  type AbortedMigration,
  abortedMigrationSchema,
  type IncomingMigration,
  type IncomingMigrationRequest,
  type MigrationOffer,
  type MigrationReport,
  type SendMigrationRequest,
  type VmInfo,
  incomingMigrationSchema,
  migrationOfferSchema,
  migrationReportSchema,
  vmInfoSchema,
} from '@fleet/agent-protocol';
import { type CallOptions } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

/** A stream of a guest's memory and disk: bounded by the caller, else by 30 minutes, not the short per-call default. */
const STREAM_TIMEOUT_MS = 30 * 60_000;

/**
 * Native live migration between two agents (the agent's migration routes,
 * agent-protocol migration.ts). None is retried: each one changes state on
 * the agent (a listener, a key, a stream sent, a guest thawed).
 */
export class MigrationRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  migrationOffer(name: string, opts?: CallOptions): Promise<MigrationOffer> {
    return this.#call({ method: 'GET', path: `/vms/${seg(name)}/migration/offer`, schema: migrationOfferSchema, idempotent: true, opts });
  }

  prepareIncoming(req: IncomingMigrationRequest, opts?: CallOptions): Promise<IncomingMigration> {
    return this.#call({
      method: 'POST',
      path: '/migrations/incoming',
      json: req,
      schema: incomingMigrationSchema,
      idempotent: false,
      opts: { ...opts, timeoutMs: opts?.timeoutMs ?? 5 * 60_000 },
    });
  }

  /** Idempotent: a second abort (or one after the ttl) answers aborted: false. */
  abortIncoming(name: string, opts?: CallOptions): Promise<AbortedMigration> {
    return this.#call({
      method: 'DELETE',
      path: `/migrations/incoming/${seg(name)}`,
      schema: abortedMigrationSchema,
      idempotent: true,
      opts,
    });
  }

  sendMigration(name: string, req: SendMigrationRequest, opts?: CallOptions): Promise<MigrationReport> {
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/migration/send`,
      json: req,
      schema: migrationReportSchema,
      idempotent: false,
      opts: { ...opts, timeoutMs: opts?.timeoutMs ?? STREAM_TIMEOUT_MS },
    });
  }

  completeIncoming(name: string, req: { keep_paused: boolean }, opts?: CallOptions): Promise<VmInfo> {
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/migration/complete`,
      json: req,
      schema: vmInfoSchema,
      idempotent: false,
      opts: { ...opts, timeoutMs: opts?.timeoutMs ?? 5 * 60_000 },
    });
  }
}
