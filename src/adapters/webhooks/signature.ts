import { createHmac, timingSafeEqual } from 'node:crypto';

/**
 * `Fleet-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`,
 * keyed with the webhook's secret. The timestamp is inside the MAC, so a
 * receiver that refuses old timestamps refuses replays too.
 */
export function signatureHeader(secret: string, body: string, unixSeconds: number): string {
  const mac = createHmac('sha256', secret).update(`${unixSeconds}.${body}`).digest('hex');
  return `t=${unixSeconds},v1=${mac}`;
}

/** The receiver's side (docs/webhooks.md shows the same in a few lines): true when the header signs this body within the tolerance. */
export function verifySignature(
  secret: string,
  body: string,
  header: string,
  toleranceS = 300,
  nowS = Math.floor(Date.now() / 1000),
): boolean {
  const parts = Object.fromEntries(header.split(',').map((kv) => kv.split('=', 2) as [string, string]));
  const t = Number(parts.t);
  if (!Number.isInteger(t) || Math.abs(nowS - t) > toleranceS || !parts.v1) return false;
  const want = Buffer.from(createHmac('sha256', secret).update(`${t}.${body}`).digest('hex'));
  const got = Buffer.from(parts.v1);
  return got.length === want.length && timingSafeEqual(got, want);
}
