import { request as httpRequest } from 'node:http';
import { request as httpsRequest } from 'node:https';
import type { Pool } from 'pg';
import type { Logger } from 'pino';
import type { SecretBox } from '../../domain/secret-box.port.js';
import { webhookSecretContext } from '../../domain/webhook/webhook.events.js';
import { isIP } from 'node:net';
import { guardedLookup, isForbiddenAddress, parseTarget } from './target-guard.js';
import { signatureHeader } from './signature.js';

export interface DispatcherOptions {
  readonly pool: Pool;
  readonly secrets: SecretBox;
  readonly logger: Logger;
  readonly allowPrivate: boolean;
  /** Failed attempts after which a delivery is dead (kept, retried only by an operator). */
  readonly maxAttempts: number;
  /** Backoff before attempt n+1: base × 2^(n-1), jittered, capped at maxBackoffMs. */
  readonly retryBaseMs: number;
  readonly maxBackoffMs: number;
  readonly timeoutMs: number;
  readonly intervalMs: number;
  readonly onOutcome?: (outcome: 'delivered' | 'failed' | 'dead') => void;
}

interface Claimed {
  seq: string;
  id: string;
  webhook_id: string;
  payload: Record<string, unknown>;
  attempts: number;
  event_type: string;
}

/** Most deliveries claimed per pass; each is the head of its own (webhook, VM) queue, so they go out concurrently. */
const BATCH = 32;

/**
 * Sends what the webhook outbox enqueued: at least once (a delivery is
 * marked delivered only after a 2xx, so a crash in between sends it again),
 * in order per webhook and VM (only the oldest pending delivery of a queue
 * is ever attempted, so a failing one holds back the later ones of its VM,
 * not those of other VMs), retried with jittered exponential backoff, and
 * dead after maxAttempts (an operator's retry puts it back). Claims are
 * row locks with SKIP LOCKED plus a lease in next_attempt_at, so replicas
 * can all run it.
 */
export class WebhookDispatcher {
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<unknown> | undefined;
  private active = false;

  constructor(private readonly opts: DispatcherOptions) {}

  start(): void {
    if (this.active) return;
    this.active = true;
    const tick = (): void => {
      if (!this.active) return;
      this.running = this.dispatchOnce()
        .catch((err: unknown) => this.opts.logger.warn({ err: { message: (err as Error).message } }, 'webhook dispatch pass failed'))
        .finally(() => {
          this.running = undefined;
          if (this.active) {
            this.timer = setTimeout(tick, this.opts.intervalMs);
            this.timer.unref();
          }
        });
    };
    tick();
  }

  async stop(): Promise<void> {
    this.active = false;
    clearTimeout(this.timer);
    await this.running;
  }

  /** One pass: claims the due heads of the queues and sends them. Returns how many were attempted. */
  async dispatchOnce(): Promise<number> {
    const leaseMs = this.opts.timeoutMs + 5000;
    const { rows } = await this.opts.pool.query<Claimed>(
      `WITH due AS (
         SELECT d.seq FROM webhook_deliveries d
          WHERE d.status = 'pending' AND d.next_attempt_at <= now()
            AND NOT EXISTS (SELECT 1 FROM webhook_deliveries p
                             WHERE p.webhook_id = d.webhook_id AND p.vm_id = d.vm_id AND p.status = 'pending' AND p.seq < d.seq)
          ORDER BY d.seq LIMIT ${BATCH} FOR UPDATE SKIP LOCKED)
       UPDATE webhook_deliveries d SET next_attempt_at = now() + $1 * interval '1 millisecond', attempts = d.attempts + 1
         FROM due WHERE d.seq = due.seq
       RETURNING d.seq, d.id, d.webhook_id, d.payload, d.attempts, d.event_type`,
      [leaseMs],
    );
    if (rows.length === 0) return 0;
    const hooks = await this.opts.pool.query<{ id: string; url: string; secret_sealed: string }>(
      'SELECT id, url, secret_sealed FROM webhooks WHERE id = ANY($1::text[])',
      [[...new Set(rows.map((r) => r.webhook_id))]],
    );
    const byId = new Map(hooks.rows.map((h) => [h.id, h]));
    await Promise.all(
      rows.map(async (d) => {
        const hook = byId.get(d.webhook_id);
        if (!hook) return;
        const body = JSON.stringify(d.payload);
        let status: number | undefined;
        let error: string | undefined;
        try {
          const secret = this.opts.secrets.open(hook.secret_sealed, webhookSecretContext(hook.id));
          status = await this.post(hook.url, body, {
            'content-type': 'application/json',
            'user-agent': 'fleet-webhooks/1',
            'fleet-signature': signatureHeader(secret, body, Math.floor(Date.now() / 1000)),
            'fleet-event-type': d.event_type,
            'fleet-delivery-id': d.id,
          });
          if (status < 200 || status > 299) error = `answered ${status}`;
        } catch (err) {
          error = (err as NodeJS.ErrnoException).code === 'WEBHOOK_TARGET_FORBIDDEN' ? (err as Error).message : describe(err);
        }
        await this.settle(d, status, error);
      }),
    );
    return rows.length;
  }

  private async settle(d: Claimed, status: number | undefined, error: string | undefined): Promise<void> {
    if (error === undefined) {
      await this.opts.pool.query(
        `UPDATE webhook_deliveries SET status = 'delivered', delivered_at = now(), last_status = $2, last_error = NULL WHERE seq = $1`,
        [d.seq, status ?? null],
      );
      this.opts.onOutcome?.('delivered');
      return;
    }
    const dead = d.attempts >= this.opts.maxAttempts;
    const backoff = Math.min(this.opts.maxBackoffMs, this.opts.retryBaseMs * 2 ** (d.attempts - 1)) * (0.75 + Math.random() / 2);
    await this.opts.pool.query(
      `UPDATE webhook_deliveries
          SET status = CASE WHEN $2 THEN 'dead' ELSE status END,
              next_attempt_at = now() + $3 * interval '1 millisecond', last_status = $4, last_error = $5
        WHERE seq = $1 AND status = 'pending'`,
      [d.seq, dead, Math.round(backoff), status ?? null, error.slice(0, 500)],
    );
    this.opts.onOutcome?.(dead ? 'dead' : 'failed');
    this.opts.logger[dead ? 'warn' : 'info'](
      { delivery_id: d.id, webhook_id: d.webhook_id, attempts: d.attempts, error },
      dead ? 'webhook delivery dead after its last attempt' : 'webhook delivery failed; retrying',
    );
  }

  /** One POST, no redirects followed (a redirect could point anywhere), the connection's address checked by guardedLookup. */
  private post(raw: string, body: string, headers: Record<string, string>): Promise<number> {
    const url = parseTarget(raw);
    // An IP literal is connected to without a lookup: checked here instead.
    const literal = url.hostname.replace(/^\[|\]$/g, '');
    if (!this.opts.allowPrivate && isIP(literal) !== 0 && isForbiddenAddress(literal)) {
      const e: NodeJS.ErrnoException = new Error(`webhook target ${literal} is in a forbidden range`);
      e.code = 'WEBHOOK_TARGET_FORBIDDEN';
      return Promise.reject(e);
    }
    const send = url.protocol === 'https:' ? httpsRequest : httpRequest;
    return new Promise((resolve, reject) => {
      const req = send(
        url,
        {
          method: 'POST',
          headers: { ...headers, 'content-length': String(Buffer.byteLength(body)) },
          lookup: guardedLookup(this.opts.allowPrivate),
          timeout: this.opts.timeoutMs,
        },
        (res) => {
          res.resume();
          res.once('end', () => resolve(res.statusCode ?? 0));
          res.once('error', reject);
        },
      );
      req.once('timeout', () => req.destroy(new Error(`no answer within ${this.opts.timeoutMs} ms`)));
      req.once('error', reject);
      req.end(body);
    });
  }
}

function describe(err: unknown): string {
  const e = err as NodeJS.ErrnoException;
  return e.code ? `${e.code}: ${e.message}` : e.message;
}
