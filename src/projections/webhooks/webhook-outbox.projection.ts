import type { RecordedEvent } from '../../domain/event-store.port.js';
import { webhookEventSchema, type WebhookEventType } from '../../domain/webhook/webhook.events.js';
import { vmEventSchema, type VmEvent } from '../../domain/vm/vm.events.js';
import type { Projection, Sql } from '../projection.js';

/**
 * The webhook consumer's half that runs in the projection runner: it keeps
 * the subscriptions (from WebhookCreated/Deleted) and, for every VM
 * lifecycle event, enqueues one delivery per live subscription of the VM's
 * tenant that asked for its type — in the runner's transaction with the
 * checkpoint, so an event is enqueued exactly once, and in log order
 * (`seq`), which is the order the dispatcher keeps per VM and webhook.
 *
 * It runs in a runner of its own, not among the read models: a rebuild of
 * the read models must never truncate deliveries (and so send them again).
 */

export const WEBHOOK_OUTBOX = 'webhook_outbox';

export const webhookOutboxMigrations = [
  {
    id: '0100_webhooks',
    sql: `CREATE TABLE IF NOT EXISTS webhooks (
            id text PRIMARY KEY,
            tenant_id text NOT NULL,
            url text NOT NULL,
            event_types text[] NOT NULL,
            secret_sealed text NOT NULL,
            created_at timestamptz NOT NULL,
            created_position text NOT NULL,
            deleted_at timestamptz
          );
          CREATE INDEX IF NOT EXISTS webhooks_tenant ON webhooks (tenant_id) WHERE deleted_at IS NULL;
          CREATE TABLE IF NOT EXISTS webhook_vm_tenants (vm_id text PRIMARY KEY, tenant_id text NOT NULL);
          CREATE TABLE IF NOT EXISTS webhook_deliveries (
            seq bigserial PRIMARY KEY,
            id text NOT NULL UNIQUE,
            webhook_id text NOT NULL REFERENCES webhooks(id),
            tenant_id text NOT NULL,
            vm_id text NOT NULL,
            event_type text NOT NULL,
            event_id text NOT NULL,
            position text NOT NULL,
            payload jsonb NOT NULL,
            status text NOT NULL DEFAULT 'pending',
            attempts int NOT NULL DEFAULT 0,
            next_attempt_at timestamptz NOT NULL DEFAULT now(),
            last_status int,
            last_error text,
            created_at timestamptz NOT NULL DEFAULT now(),
            delivered_at timestamptz,
            UNIQUE (webhook_id, event_id)
          );
          CREATE INDEX IF NOT EXISTS webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
          CREATE INDEX IF NOT EXISTS webhook_deliveries_queue ON webhook_deliveries (webhook_id, vm_id, seq) WHERE status = 'pending';`,
  },
];

/** The payload a receiver gets: the lifecycle change as the tenant may see it (no sealed fields, no spec). */
export interface WebhookPayload {
  readonly id: string;
  readonly event: WebhookEventType;
  readonly vm_id: string;
  readonly tenant_id: string;
  readonly position: string;
  readonly at: string;
  readonly data: Record<string, unknown>;
}

function shape(e: VmEvent): { event: WebhookEventType; data: Record<string, unknown> } | undefined {
  switch (e.type) {
    case 'VmRequested':
      return { event: 'vm.requested', data: { state: 'requested', ...(e.data.task_id ? { task_id: e.data.task_id } : {}) } };
    case 'VmPlaced':
      return { event: 'vm.placed', data: { state: 'placed', host_id: e.data.host_id } };
    case 'VmBootStarted':
      return { event: 'vm.booting', data: { state: 'booting' } };
    case 'VmBooted':
      return { event: 'vm.booted', data: { state: 'running', url: e.data.url, endpoints: e.data.endpoints, boot_ms: e.data.boot_ms } };
    case 'VmDestroyRequested':
      return { event: 'vm.destroying', data: { state: 'destroying', reason: e.data.reason } };
    case 'VmDestroyed':
      return { event: 'vm.destroyed', data: { state: 'destroyed', reason: e.data.reason } };
    case 'VmFailed':
      return {
        event: 'vm.failed',
        data: {
          state: 'failed',
          reason: e.data.reason,
          error: e.data.error,
          error_code: e.data.error_code ?? null,
          phase: e.data.phase,
          ...(e.data.exit_code !== undefined ? { exit_code: e.data.exit_code } : {}),
          ...(e.data.exit_signal !== undefined ? { exit_signal: e.data.exit_signal } : {}),
        },
      };
    case 'VmMigrated':
      return { event: 'vm.migrated', data: { state: 'running', host_id: e.data.host_id, url: e.data.url, endpoints: e.data.endpoints } };
    case 'VmOomKilled':
      return {
        event: 'vm.oom_killed',
        data: { process: e.data.process, pid: e.data.pid ?? null, limit_mb: e.data.limit_mb, count: e.data.count },
      };
    case 'VmActivityRecorded':
      return undefined;
  }
}

async function applyOne(sql: Sql, event: RecordedEvent): Promise<void> {
  if (event.streamId.startsWith('webhook-')) {
    const parsed = webhookEventSchema.safeParse({ type: event.type, data: event.data });
    if (!parsed.success) return;
    const e = parsed.data;
    if (e.type === 'WebhookCreated') {
      await sql.query(
        `INSERT INTO webhooks (id, tenant_id, url, event_types, secret_sealed, created_at, created_position)
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO NOTHING`,
        [e.data.webhook_id, e.data.tenant_id, e.data.url, e.data.event_types, e.data.secret_sealed, e.data.at, event.position],
      );
    } else {
      await sql.query('UPDATE webhooks SET deleted_at = $2 WHERE id = $1 AND deleted_at IS NULL', [e.data.webhook_id, e.data.at]);
      // Nothing more goes to a deleted webhook, retries included.
      await sql.query(
        `UPDATE webhook_deliveries SET status = 'cancelled', last_error = 'the webhook was deleted' WHERE webhook_id = $1 AND status = 'pending'`,
        [e.data.webhook_id],
      );
    }
    return;
  }
  if (!event.streamId.startsWith('vm-')) return;
  const parsed = vmEventSchema.safeParse({ type: event.type, data: event.data });
  if (!parsed.success) return;
  const e = parsed.data;
  if (e.type === 'VmRequested') {
    await sql.query('INSERT INTO webhook_vm_tenants (vm_id, tenant_id) VALUES ($1, $2) ON CONFLICT (vm_id) DO NOTHING', [
      e.data.vm_id,
      e.data.tenant_id,
    ]);
  }
  const shaped = shape(e);
  if (!shaped) return;
  const tenant = await sql.query<{ tenant_id: string }>('SELECT tenant_id FROM webhook_vm_tenants WHERE vm_id = $1', [e.data.vm_id]);
  const tenantId = tenant.rows[0]?.tenant_id;
  if (tenantId === undefined) return;
  const subs = await sql.query<{ id: string }>(
    'SELECT id FROM webhooks WHERE tenant_id = $1 AND deleted_at IS NULL AND $2 = ANY(event_types) ORDER BY id',
    [tenantId, shaped.event],
  );
  for (const { id: webhookId } of subs.rows) {
    const deliveryId = `${webhookId}-${event.id}`;
    const payload: WebhookPayload = {
      id: deliveryId,
      event: shaped.event,
      vm_id: e.data.vm_id,
      tenant_id: tenantId,
      position: event.position,
      at: e.data.at,
      data: shaped.data,
    };
    await sql.query(
      `INSERT INTO webhook_deliveries (id, webhook_id, tenant_id, vm_id, event_type, event_id, position, payload)
       VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (webhook_id, event_id) DO NOTHING`,
      [deliveryId, webhookId, tenantId, e.data.vm_id, shaped.event, event.id, event.position, JSON.stringify(payload)],
    );
  }
}

/**
 * The same as `applyOne` on each event, in a few statements per run of VM
 * events (a webhook's own event in between is applied on its own, so a run
 * sees the subscriptions as they stood): the run's tenants recorded, its
 * deliveries looked up in one join and inserted in log order. One event at a
 * time this was two lookups per event whether or not any webhook exists.
 */
async function applyOutboxBatch(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  let run: Array<{ event: RecordedEvent; e: VmEvent }> = [];
  for (const event of events) {
    if (event.streamId.startsWith('vm-')) {
      const parsed = vmEventSchema.safeParse({ type: event.type, data: event.data });
      if (parsed.success) run.push({ event, e: parsed.data });
    } else if (event.streamId.startsWith('webhook-')) {
      await applyVmRun(sql, run);
      run = [];
      await applyOne(sql, event);
    }
  }
  await applyVmRun(sql, run);
}

async function applyVmRun(sql: Sql, run: ReadonlyArray<{ event: RecordedEvent; e: VmEvent }>): Promise<void> {
  const requested = run.flatMap(({ e }) => (e.type === 'VmRequested' ? [e.data] : []));
  if (requested.length > 0) {
    await sql.query(
      `INSERT INTO webhook_vm_tenants (vm_id, tenant_id) SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT (vm_id) DO NOTHING`,
      [requested.map((d) => d.vm_id), requested.map((d) => d.tenant_id)],
    );
  }
  const shaped = run.flatMap(({ event, e }) => {
    const s = shape(e);
    return s ? [{ recorded: event, e, type: s.event, data: s.data }] : [];
  });
  if (shaped.length === 0) return;
  const { rows } = await sql.query<{ ord: string; tenant_id: string; webhook_id: string }>(
    `SELECT x.ord, t.tenant_id, w.id AS webhook_id
       FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS x(vm_id, event, ord)
       JOIN webhook_vm_tenants t ON t.vm_id = x.vm_id
       JOIN webhooks w ON w.tenant_id = t.tenant_id AND w.deleted_at IS NULL AND x.event = ANY(w.event_types)
      ORDER BY x.ord, w.id`,
    [shaped.map((s) => s.e.data.vm_id), shaped.map((s) => s.type)],
  );
  if (rows.length === 0) return;
  const cols: string[][] = [[], [], [], [], [], [], [], []];
  for (const r of rows) {
    const { recorded, e, type, data } = shaped[Number(r.ord) - 1] as (typeof shaped)[number];
    const deliveryId = `${r.webhook_id}-${recorded.id}`;
    const payload: WebhookPayload = {
      id: deliveryId,
      event: type,
      vm_id: e.data.vm_id,
      tenant_id: r.tenant_id,
      position: recorded.position,
      at: e.data.at,
      data,
    };
    const values = [deliveryId, r.webhook_id, r.tenant_id, e.data.vm_id, type, recorded.id, recorded.position, JSON.stringify(payload)];
    values.forEach((v, i) => cols[i]?.push(v));
  }
  // In log order (the rows are), so `seq` keeps the order the dispatcher follows per VM and webhook.
  await sql.query(
    `INSERT INTO webhook_deliveries (id, webhook_id, tenant_id, vm_id, event_type, event_id, position, payload)
     SELECT id, webhook_id, tenant_id, vm_id, event_type, event_id, position, payload::jsonb
       FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
            WITH ORDINALITY AS d(id, webhook_id, tenant_id, vm_id, event_type, event_id, position, payload, ord)
      ORDER BY ord
     ON CONFLICT (webhook_id, event_id) DO NOTHING`,
    cols,
  );
}

export const webhookOutboxProjection: Projection = {
  name: WEBHOOK_OUTBOX,
  migrations: webhookOutboxMigrations,
  // Owns no table a rebuild may truncate: see above.
  tables: [],
  apply: applyOne,
  applyBatch: applyOutboxBatch,
};
