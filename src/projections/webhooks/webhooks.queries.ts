import type { Pool } from 'pg';

export interface WebhookRow {
  id: string;
  tenant_id: string;
  url: string;
  event_types: string[];
  created_at: Date;
  deleted_at: Date | null;
}

export interface DeliveryRow {
  id: string;
  webhook_id: string;
  vm_id: string;
  event_type: string;
  position: string;
  status: string;
  attempts: number;
  next_attempt_at: Date;
  last_status: number | null;
  last_error: string | null;
  created_at: Date;
  delivered_at: Date | null;
}

/** A tenant's live webhooks (every tenant's for an admin: tenant undefined). */
export async function listWebhooks(pool: Pool, tenant: string | undefined): Promise<WebhookRow[]> {
  const { rows } = await pool.query<WebhookRow>(
    `SELECT id, tenant_id, url, event_types, created_at, deleted_at FROM webhooks
      WHERE deleted_at IS NULL AND ($1::text IS NULL OR tenant_id = $1) ORDER BY created_at, id`,
    [tenant ?? null],
  );
  return rows;
}

export async function getWebhook(pool: Pool, id: string): Promise<WebhookRow | undefined> {
  const { rows } = await pool.query<WebhookRow>(
    'SELECT id, tenant_id, url, event_types, created_at, deleted_at FROM webhooks WHERE id = $1',
    [id],
  );
  return rows[0];
}

export async function listDeliveries(
  pool: Pool,
  webhookId: string,
  q: { status?: string | undefined; limit: number; beforeSeq?: string | undefined },
): Promise<Array<DeliveryRow & { seq: string }>> {
  const { rows } = await pool.query<DeliveryRow & { seq: string }>(
    `SELECT seq, id, webhook_id, vm_id, event_type, position, status, attempts, next_attempt_at, last_status, last_error, created_at, delivered_at
       FROM webhook_deliveries
      WHERE webhook_id = $1 AND ($2::text IS NULL OR status = $2) AND ($3::bigint IS NULL OR seq < $3)
      ORDER BY seq DESC LIMIT $4`,
    [webhookId, q.status ?? null, q.beforeSeq ?? null, q.limit],
  );
  return rows;
}

/** An operator's retry of a dead delivery: pending again, attempts from zero, due now. False when it is not dead. */
export async function retryDeadDelivery(pool: Pool, webhookId: string, deliveryId: string): Promise<boolean> {
  const r = await pool.query(
    `UPDATE webhook_deliveries SET status = 'pending', attempts = 0, next_attempt_at = now()
      WHERE webhook_id = $1 AND id = $2 AND status = 'dead'`,
    [webhookId, deliveryId],
  );
  return (r.rowCount ?? 0) > 0;
}
