import type { Pool, PoolClient } from 'pg';
import type { EventStore, Position, RecordedEvent } from '../domain/event-store.port.js';
import type { Projection } from './projection.js';

export interface TableDrift {
  readonly table: string;
  /** Rows the live table has that the rebuild does not (or has differently). */
  readonly onlyLive: number;
  /** Rows the rebuild has that the live table does not (or has differently). */
  readonly onlyRebuilt: number;
  /** Up to five keys of differing rows, for the operator to look at. */
  readonly sampleKeys: string[];
}

export interface RebuildReport {
  readonly projection: string;
  readonly events: number;
  readonly position: Position | undefined;
  readonly mode: 'replaced' | 'verified';
  readonly drift: TableDrift[];
  readonly seconds: number;
}

const PAGE = 2000;

/**
 * Rebuilds a read model from position zero into a shadow schema, then either
 * compares it with the live tables (`verify`) or swaps it in. The final step
 * holds the live checkpoint row locked (FOR UPDATE), so the live runner
 * cannot move while the two are brought to the same position and compared or
 * swapped: drift is real drift, not lag.
 */
export async function rebuildProjection(
  store: EventStore,
  pool: Pool,
  projection: Projection,
  opts: { verify: boolean; onProgress?: (events: number, position: Position | undefined) => void },
): Promise<RebuildReport> {
  const started = Date.now();
  const shadow = `rebuild_${projection.name.replace(/[^a-z0-9_]/g, '_')}`;
  const client = await pool.connect();
  try {
    await client.query(`DROP SCHEMA IF EXISTS ${shadow} CASCADE`);
    await client.query(`CREATE SCHEMA ${shadow}`);
    await client.query(`SET search_path TO ${shadow}`);
    for (const m of projection.migrations) await client.query(m.sql);

    // Verify compares at the live position, so the catch-up stops there; a swap goes to the head.
    const live0 = opts.verify ? await liveCheckpoint(client, projection.name, false) : undefined;
    let position: Position | undefined;
    let events = 0;
    const applyUpTo = async (limit: Position | undefined, bounded: boolean, inTransaction: boolean): Promise<void> => {
      for (;;) {
        const page = await store.readAll({ after: position, maxCount: PAGE });
        const batch = bounded ? page.filter((e) => limit !== undefined && e.position <= limit) : page;
        const last = batch.at(-1);
        if (last) {
          await applyBatch(client, projection, batch, inTransaction);
          position = last.position;
          events += batch.length;
          opts.onProgress?.(events, position);
        }
        if (page.length < PAGE || batch.length < page.length) return;
      }
    };
    await applyUpTo(live0, opts.verify, false);

    await client.query('BEGIN');
    try {
      const live = await liveCheckpoint(client, projection.name, true);
      if (live !== undefined && (position === undefined || live > position)) await applyUpTo(live, true, true);
      const drift: TableDrift[] = [];
      if (opts.verify) {
        for (const t of projection.tables) drift.push(await compare(client, shadow, t.name, t.key));
        await client.query('ROLLBACK');
      } else {
        for (const t of projection.tables) {
          await client.query(`TRUNCATE public.${t.name}`);
          await client.query(`INSERT INTO public.${t.name} SELECT * FROM ${shadow}.${t.name}`);
        }
        await client.query(
          `INSERT INTO public.projection_checkpoints (name, position, events_applied, updated_at) VALUES ($1, $2, $3, now())
           ON CONFLICT (name) DO UPDATE SET position = $2, events_applied = $3, updated_at = now()`,
          [projection.name, position ?? null, events],
        );
        await client.query('COMMIT');
      }
      return {
        projection: projection.name,
        events,
        position,
        mode: opts.verify ? 'verified' : 'replaced',
        drift,
        seconds: (Date.now() - started) / 1000,
      };
    } catch (err) {
      await client.query('ROLLBACK').catch(() => undefined);
      throw err;
    }
  } finally {
    await client.query(`DROP SCHEMA IF EXISTS ${shadow} CASCADE`).catch(() => undefined);
    await client.query('SET search_path TO DEFAULT').catch(() => undefined);
    client.release();
  }
}

async function liveCheckpoint(client: PoolClient, name: string, lock: boolean): Promise<Position | undefined> {
  const { rows } = await client.query<{ position: string | null }>(
    `SELECT position FROM public.projection_checkpoints WHERE name = $1${lock ? ' FOR UPDATE' : ''}`,
    [name],
  );
  return rows[0]?.position ?? undefined;
}

async function applyBatch(client: PoolClient, projection: Projection, batch: readonly RecordedEvent[], inTx: boolean): Promise<void> {
  if (!inTx) await client.query('BEGIN');
  try {
    if (projection.applyBatch) await projection.applyBatch(client, batch);
    else for (const e of batch) await projection.apply(client, e);
    if (!inTx) await client.query('COMMIT');
  } catch (err) {
    if (!inTx) await client.query('ROLLBACK').catch(() => undefined);
    throw err;
  }
}

async function compare(client: PoolClient, shadow: string, table: string, key: readonly string[]): Promise<TableDrift> {
  const keyExpr = key.map((k) => `${k}::text`).join(` || '/' || `);
  const diff = async (a: string, b: string): Promise<{ n: number; keys: string[] }> => {
    const { rows } = await client.query<{ k: string }>(
      `SELECT ${keyExpr} AS k FROM (SELECT * FROM ${a}.${table} EXCEPT ALL SELECT * FROM ${b}.${table}) d ORDER BY 1`,
    );
    return { n: rows.length, keys: rows.slice(0, 5).map((r) => r.k) };
  };
  const onlyLive = await diff('public', shadow);
  const onlyRebuilt = await diff(shadow, 'public');
  return {
    table,
    onlyLive: onlyLive.n,
    onlyRebuilt: onlyRebuilt.n,
    sampleKeys: [...new Set([...onlyLive.keys, ...onlyRebuilt.keys])].slice(0, 5),
  };
}
