import pg from 'pg';
import type { Logger } from '../logger.js';

/**
 * int8/bigint: we keep node-postgres' default and receive int8 columns as
 * strings, converting with BigInt() where a revision or position is read. We
 * never install a global type parser: a Number would silently round above
 * 2^53, and a global BigInt parser would change every other query in the
 * process (COUNT(*) included) behind its author's back.
 */
export interface PoolOptions {
  readonly url: string;
  readonly max?: number | undefined;
  readonly applicationName?: string | undefined;
  readonly logger?: Logger | undefined;
  /** Per-statement limit in ms, 0 for none. Default 0. */
  readonly statementTimeoutMs?: number | undefined;
}

export function createPool(options: PoolOptions): pg.Pool {
  const pool = new pg.Pool({
    connectionString: options.url,
    max: options.max ?? 10,
    application_name: options.applicationName ?? 'fleet-control-plane',
    connectionTimeoutMillis: 10_000,
    idleTimeoutMillis: 30_000,
    ...(options.statementTimeoutMs ? { statement_timeout: options.statementTimeoutMs } : {}),
  });
  // An idle client losing its connection (server restart) emits here; without a listener it would crash the process.
  pool.on('error', (err) =>
    options.logger?.warn({ err: { message: err.message, code: (err as { code?: string }).code } }, 'idle Postgres connection failed'),
  );
  return pool;
}

/** The connection string without its password, for logs. */
export function redactUrl(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = '***';
    return u.toString();
  } catch {
    return '<unparseable url>';
  }
}
