import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { ValidationError, NotFoundError } from '@fleet/agent-protocol';
import { assertStreamName, streamCategory, type EventStore, type JsonValue, type RecordedEvent } from '../../domain/event-store.port.js';
import { eventTime, upTo, type AsOf } from '../../commands/vm/vm-history.js';
import { TENANT_STREAM_PREFIX } from '../../domain/snapshot/snapshot.events.js';
import { upgradeVmEventData } from '../../domain/vm/vm.lifecycle.js';
import type { Caller } from './auth.js';
import { problemResponses } from './common.js';

export { vmAsOf, type AsOf } from '../../commands/vm/vm-history.js';

/** One event as an auditor reads it. */
export interface AuditEntry {
  readonly position: string;
  readonly revision: string;
  readonly event_id: string;
  readonly type: string;
  /** When it happened (the event's own `at`), else when it was stored. */
  readonly time: string;
  readonly recorded_at: string;
  readonly actor: string | null;
  readonly tenant_id: string | null;
  readonly correlation_id: string | null;
  readonly causation_id: string | null;
  readonly data: JsonValue;
  /**
   * For an event that ends a VM: its reason in the closed set, as the VM reads
   * it (an event written before the set shows its old reason in `data`).
   */
  readonly end_reason?: string;
}

/**
 * Ciphertext is no use to an auditor and no business of a log reader: fields
 * holding it are shown as sealed. So are the fields that may hold
 * credentials in clear in events written before sealing existed (a startup
 * script, the in-guest agent's command and drain command, secrets).
 */
export function redactSealed(value: JsonValue, parentKey?: string): JsonValue {
  if (Array.isArray(value)) return value.map((v) => redactSealed(v));
  if (value !== null && typeof value === 'object') {
    const out: { [k: string]: JsonValue } = {};
    for (const [k, v] of Object.entries(value)) {
      const sealed =
        /_encrypted$/.test(k) ||
        k === 'startup_script' ||
        k === 'secrets' ||
        (parentKey === 'agent' && (k === 'command' || k === 'drain_command'));
      out[k] = sealed ? '[sealed]' : redactSealed(v, k);
    }
    return out;
  }
  return value;
}

export function toAuditEntry(e: RecordedEvent): AuditEntry {
  return {
    position: e.position,
    revision: e.revision.toString(),
    event_id: e.id,
    type: e.type,
    time: eventTime(e),
    recorded_at: e.created.toISOString(),
    actor: e.metadata.actor ?? null,
    tenant_id: e.metadata.tenantId ?? null,
    correlation_id: e.metadata.correlationId ?? null,
    causation_id: e.metadata.causationId ?? null,
    data: redactSealed(e.data),
    ...endReasonOf(e),
  };
}

function endReasonOf(e: RecordedEvent): { end_reason?: string } {
  if (!e.streamId.startsWith('vm-') || !['VmDestroyRequested', 'VmDestroyed', 'VmFailed'].includes(e.type)) return {};
  const reason = (upgradeVmEventData(e.type, e.data, e.metadata) as { reason?: unknown } | null)?.reason;
  return typeof reason === 'string' ? { end_reason: reason } : {};
}

/** Who owns a stream: the tenant named by its first event (VM, snapshot) or by its id (tenant-…); hosts and the rest are the operator's. */
export async function streamOwner(store: EventStore, stream: string): Promise<string | undefined> {
  const category = streamCategory(stream);
  if (category === 'tenant') return stream.slice(TENANT_STREAM_PREFIX.length);
  if (category !== 'vm' && category !== 'snapshot') return undefined;
  const [first] = await store.readStream(stream, { maxCount: 1 });
  const t = (first?.data as { tenant_id?: unknown } | null)?.tenant_id;
  return typeof t === 'string' ? t : undefined;
}

/** `as_of` as a caller gives it: a position as the API returns them, or an ISO-8601 time. */
export function parseAsOf(store: EventStore, value: string): AsOf {
  if (/^[0-9a-f]{16}-[0-9a-f]{16}$/.test(value)) return { position: store.parsePosition(value) };
  const t = new Date(value);
  if (!/^\d{4}-\d{2}-\d{2}T/.test(value) || Number.isNaN(t.getTime())) {
    throw new ValidationError(
      `as_of ${JSON.stringify(value)} is neither a position (<16 hex>-<16 hex>) nor an ISO-8601 time such as 2026-01-01T12:00:00Z`,
      [{ path: 'querystring.as_of', message: 'not a position or a time' }],
    );
  }
  return { time: t };
}

export interface AuditRoutesDeps {
  readonly store: EventStore;
}

function canRead(caller: Caller, owner: string | undefined): boolean {
  return caller.admin || (owner !== undefined && owner === caller.tenantId);
}

export function auditRoutes(deps: AuditRoutesDeps) {
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    const entry = z.object({
      position: z.string(),
      revision: z.string(),
      event_id: z.string(),
      type: z.string(),
      time: z.string(),
      recorded_at: z.string(),
      actor: z.string().nullable(),
      tenant_id: z.string().nullable(),
      correlation_id: z.string().nullable(),
      causation_id: z.string().nullable(),
      data: z.unknown(),
      end_reason: z.string().optional(),
    });
    app.get(
      '/v1/audit/streams/:stream',
      {
        schema: {
          tags: ['audit'],
          summary: "One stream's full history (vm-…, host-…, snapshot-…, tenant-…): admin, or the tenant that owns it",
          params: z.object({ stream: z.string().min(1).max(200) }),
          querystring: z.object({
            from_revision: z.coerce.number().int().nonnegative().optional(),
            limit: z.coerce.number().int().min(1).max(10_000).default(1000),
            as_of: z.string().optional(),
          }),
          response: {
            200: z.object({
              stream: z.string(),
              owner: z.string().nullable(),
              events: z.array(entry),
              next_revision: z.string().nullable(),
            }),
            ...problemResponses,
          },
        },
      },
      async (req) => {
        const { stream } = req.params;
        assertStreamName(stream);
        const asOf = req.query.as_of !== undefined ? parseAsOf(deps.store, req.query.as_of) : undefined;
        const owner = await streamOwner(deps.store, stream);
        const notFound = new NotFoundError('STREAM_NOT_FOUND', `stream ${stream} does not exist`, { stream });
        if (!canRead(req.caller, owner)) throw notFound;
        const page = await deps.store.readStream(stream, {
          fromRevision: req.query.from_revision !== undefined ? BigInt(req.query.from_revision) : undefined,
          maxCount: req.query.limit + 1,
        });
        if (page.length === 0 && req.query.from_revision === undefined) throw notFound;
        const next = page[req.query.limit];
        const shown = asOf ? upTo(page.slice(0, req.query.limit), asOf) : page.slice(0, req.query.limit);
        return {
          stream,
          owner: owner ?? null,
          events: shown.map(toAuditEntry),
          next_revision: next && (!asOf || shown.length === req.query.limit) ? next.revision.toString() : null,
        };
      },
    );
  };
}
