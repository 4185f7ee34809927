import { createHash } from 'node:crypto';
import type pg from 'pg';
import type { Logger } from '../logger.js';

export interface Migration {
  /** Unique across every layer sharing the database: prefix it with its owner, e.g. `event-store/001-events`. */
  readonly id: string;
  readonly sql: string;
}

export class MigrationError extends Error {
  readonly code: string;
  constructor(code: string, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'MigrationError';
    this.code = code;
  }
}

// One lock for every layer's migrations: replicas starting at once apply them one at a time.
const LOCK_KEY = 7_201_450_113_582_093n;

function checksum(sql: string): string {
  return createHash('sha256').update(sql).digest('hex');
}

/**
 * Applies, in the order given, each migration not yet recorded in
 * `schema_migrations`, each in its own transaction with its record. Holding a
 * session advisory lock for the whole run makes concurrent callers (replicas
 * starting together) wait and then find the work done. A recorded migration
 * whose SQL has changed is an error: editing an applied migration silently
 * does nothing, so we refuse rather than run with a schema nobody wrote.
 */
export async function runMigrations(
  pool: pg.Pool,
  migrations: readonly Migration[],
  options: { logger?: Logger | undefined; lockTimeoutMs?: number | undefined } = {},
): Promise<{ applied: string[] }> {
  const seen = new Set<string>();
  for (const m of migrations) {
    if (typeof m.id !== 'string' || m.id.trim() === '') throw new MigrationError('MIGRATION_INVALID', 'a migration has an empty id');
    if (seen.has(m.id)) throw new MigrationError('MIGRATION_INVALID', `migration id ${m.id} appears twice`);
    if (typeof m.sql !== 'string' || m.sql.trim() === '') throw new MigrationError('MIGRATION_INVALID', `migration ${m.id} has no SQL`);
    seen.add(m.id);
  }
  const client = await pool.connect();
  let broken: Error | undefined;
  const applied: string[] = [];
  try {
    await client.query(`SET lock_timeout = ${Math.max(0, Math.floor(options.lockTimeoutMs ?? 120_000))}`);
    try {
      await client.query('SELECT pg_advisory_lock($1)', [LOCK_KEY.toString()]);
    } catch (cause) {
      throw new MigrationError(
        'MIGRATION_LOCK_TIMEOUT',
        'timed out waiting for the migration lock: another process is migrating this database (or hung doing so)',
        { cause },
      );
    }
    try {
      await client.query('SET lock_timeout = 0');
      await client.query(`CREATE TABLE IF NOT EXISTS schema_migrations (
        id text PRIMARY KEY,
        checksum text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
      )`);
      const done = new Map<string, string>();
      for (const row of (await client.query<{ id: string; checksum: string }>('SELECT id, checksum FROM schema_migrations')).rows)
        done.set(row.id, row.checksum);
      for (const m of migrations) {
        const sum = checksum(m.sql);
        const recorded = done.get(m.id);
        if (recorded !== undefined) {
          if (recorded !== sum) {
            throw new MigrationError(
              'MIGRATION_CHANGED',
              `migration ${m.id} was applied with different SQL; add a new migration instead of editing an applied one (or reset the database)`,
            );
          }
          continue;
        }
        await client.query('BEGIN');
        try {
          await client.query(m.sql);
          await client.query('INSERT INTO schema_migrations (id, checksum) VALUES ($1, $2)', [m.id, sum]);
          await client.query('COMMIT');
        } catch (cause) {
          await client.query('ROLLBACK').catch(() => undefined);
          throw new MigrationError('MIGRATION_FAILED', `migration ${m.id} failed and was rolled back: ${(cause as Error).message}`, {
            cause,
          });
        }
        applied.push(m.id);
        options.logger?.info({ migration: m.id }, 'applied migration');
      }
    } finally {
      await client.query('SELECT pg_advisory_unlock($1)', [LOCK_KEY.toString()]).catch((err: unknown) => {
        broken = err as Error;
      });
    }
  } finally {
    // A connection whose unlock failed may still hold the lock: destroy it rather than return it to the pool.
    client.release(broken);
  }
  return { applied };
}
