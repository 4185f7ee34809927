import type { Sql } from '../projection.js';

export interface DeadLetterRow {
  id: string;
  kind: string;
  entity_id: string;
  host_id: string;
  vm_id: string | null;
  state: string;
  reason: string;
  error_code: string | null;
  retry_count: number;
  first_seen_at: string;
  last_seen_at: string;
  updated_at: string;
  resolution: string | null;
  actor: string | null;
}

const COLUMNS = `id, kind, entity_id, host_id, vm_id, state, reason, error_code, retry_count, first_seen_at, last_seen_at, updated_at, resolution, actor`;

function toRow(r: Record<string, unknown>): DeadLetterRow {
  return {
    ...(r as unknown as DeadLetterRow),
    first_seen_at: (r.first_seen_at as Date).toISOString(),
    last_seen_at: (r.last_seen_at as Date).toISOString(),
    updated_at: (r.updated_at as Date).toISOString(),
  };
}

/** Newest first; `state` filters (open, retrying, discarded, resolved). */
export async function listDeadLetters(
  sql: Sql,
  opts: { state?: string | undefined; limit: number; after?: { last_seen_at: string; id: string } | undefined },
): Promise<DeadLetterRow[]> {
  const { rows } = await sql.query(
    `SELECT ${COLUMNS} FROM dead_letters
      WHERE ($1::text IS NULL OR state = $1)
        AND ($2::timestamptz IS NULL OR (last_seen_at, id) < ($2::timestamptz, $3::text))
      ORDER BY last_seen_at DESC, id DESC LIMIT $4`,
    [opts.state ?? null, opts.after?.last_seen_at ?? null, opts.after?.id ?? null, opts.limit],
  );
  return rows.map(toRow);
}

export async function getDeadLetter(sql: Sql, id: string): Promise<DeadLetterRow | undefined> {
  const { rows } = await sql.query(`SELECT ${COLUMNS} FROM dead_letters WHERE id = $1`, [id]);
  return rows[0] ? toRow(rows[0]) : undefined;
}

export async function countDeadLettersByState(sql: Sql): Promise<Array<{ state: string; kind: string; count: number }>> {
  const { rows } = await sql.query<{ state: string; kind: string; count: string }>(
    `SELECT state, kind, count(*) AS count FROM dead_letters GROUP BY state, kind`,
  );
  return rows.map((r) => ({ state: r.state, kind: r.kind, count: Number(r.count) }));
}
