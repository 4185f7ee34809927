import { isDeadLetterEventType, parseDeadLetterEvent, DEADLETTER_STREAM_PREFIX } from '../../domain/deadletter/deadletter.events.js';
import type { RecordedEvent } from '../../domain/event-store.port.js';
import type { Projection, Sql } from '../projection.js';

/** The `dead_letters` read model: what `GET /v1/dead-letters` lists and what the reconciler skips. */
export const deadLettersProjection: Projection = {
  name: 'dead_letters',
  migrations: [
    {
      id: 'dead_letters_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS dead_letters (
          id text PRIMARY KEY,
          kind text NOT NULL,
          entity_id text NOT NULL,
          host_id text NOT NULL,
          vm_id text,
          state text NOT NULL,
          reason text NOT NULL,
          error_code text,
          retry_count integer NOT NULL,
          first_seen_at timestamptz NOT NULL,
          last_seen_at timestamptz NOT NULL,
          updated_at timestamptz NOT NULL,
          resolution text,
          actor text,
          revision bigint NOT NULL
        );
        CREATE INDEX IF NOT EXISTS dead_letters_state_idx ON dead_letters (state, last_seen_at DESC);`,
    },
  ],
  tables: [{ name: 'dead_letters', key: ['id'] }],
  async apply(sql: Sql, recorded: RecordedEvent): Promise<void> {
    if (!recorded.streamId.startsWith(DEADLETTER_STREAM_PREFIX) || !isDeadLetterEventType(recorded.type)) return;
    const event = parseDeadLetterEvent(recorded.type, recorded.data);
    const rev = recorded.revision.toString();
    const d = event.data;
    switch (event.type) {
      case 'DeadLettered': {
        const e = event.data;
        await sql.query(
          `INSERT INTO dead_letters (id, kind, entity_id, host_id, vm_id, state, reason, error_code, retry_count, first_seen_at, last_seen_at, updated_at, revision)
           VALUES ($1, $2, $3, $4, $5, 'open', $6, $7, $8, $9, $10, $10, $11)
           ON CONFLICT (id) DO UPDATE SET state = 'open', reason = EXCLUDED.reason, error_code = EXCLUDED.error_code, retry_count = EXCLUDED.retry_count,
             last_seen_at = EXCLUDED.last_seen_at, updated_at = EXCLUDED.updated_at, resolution = NULL, actor = NULL, revision = EXCLUDED.revision`,
          [
            e.id,
            e.kind,
            e.entity_id,
            e.host_id,
            e.vm_id ?? null,
            e.reason,
            e.error_code ?? null,
            e.retry_count,
            e.first_failed_at,
            e.at,
            rev,
          ],
        );
        return;
      }
      case 'DeadLetterRetryRequested':
        await sql.query(`UPDATE dead_letters SET state = 'retrying', actor = $2, updated_at = $3, revision = $4 WHERE id = $1`, [
          d.id,
          event.data.actor,
          d.at,
          rev,
        ]);
        return;
      case 'DeadLetterDiscarded':
        await sql.query(
          `UPDATE dead_letters SET state = 'discarded', actor = $2, resolution = $3, updated_at = $4, revision = $5 WHERE id = $1`,
          [d.id, event.data.actor, event.data.note ?? null, d.at, rev],
        );
        return;
      case 'DeadLetterResolved':
        await sql.query(`UPDATE dead_letters SET state = 'resolved', resolution = $2, updated_at = $3, revision = $4 WHERE id = $1`, [
          d.id,
          event.data.outcome,
          d.at,
          rev,
        ]);
        return;
    }
  },
};
