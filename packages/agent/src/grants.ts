import { createHmac, timingSafeEqual } from 'node:crypto';

/**
 * Artifact grants: `<payload>.<mac>`, both base64url, where payload is
 * `{"s": snapshot id, "e": expiry in unix ms}` and mac is HMAC-SHA256 over
 * the payload with this host's grant secret. Scoped to one snapshot and
 * short-lived, so a leaked grant reads one artifact for minutes, never the
 * host's API.
 */

export type GrantCheck = { ok: true } | { ok: false; reason: 'invalid' | 'expired' | 'wrong_snapshot' };

export function mintGrant(secret: Buffer, snapshotId: string, expiresAtMs: number): string {
  const payload = Buffer.from(JSON.stringify({ s: snapshotId, e: expiresAtMs })).toString('base64url');
  return `${payload}.${mac(secret, payload)}`;
}

export function verifyGrant(secret: Buffer, grant: string, snapshotId: string, nowMs: number): GrantCheck {
  const dot = grant.indexOf('.');
  if (dot <= 0 || grant.length > 1024) return { ok: false, reason: 'invalid' };
  const payload = grant.slice(0, dot);
  const given = Buffer.from(grant.slice(dot + 1), 'base64url');
  const expected = Buffer.from(mac(secret, payload), 'base64url');
  if (given.length !== expected.length || !timingSafeEqual(given, expected)) return { ok: false, reason: 'invalid' };
  let body: unknown;
  try {
    body = JSON.parse(Buffer.from(payload, 'base64url').toString('utf8'));
  } catch {
    return { ok: false, reason: 'invalid' };
  }
  const { s, e } = (body ?? {}) as { s?: unknown; e?: unknown };
  if (typeof s !== 'string' || typeof e !== 'number') return { ok: false, reason: 'invalid' };
  if (s !== snapshotId) return { ok: false, reason: 'wrong_snapshot' };
  if (e <= nowMs) return { ok: false, reason: 'expired' };
  return { ok: true };
}

function mac(secret: Buffer, payload: string): string {
  return createHmac('sha256', secret).update(payload).digest('base64url');
}
