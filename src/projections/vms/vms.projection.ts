import type { RecordedEvent } from '../../domain/event-store.port.js';
import { publicSpec } from '../../domain/vm/spec.js';
import { isVmEventType } from '../../domain/vm/vm.events.js';
import { parsedVmEvent } from '../parsed-events.js';
import type { Projection, Sql } from '../projection.js';

/**
 * The `vms` read model: what the API lists and gets. One row per VM, every
 * field taken from its events (times included), so a rebuild reproduces it.
 * The spec is stored as reads show it (`publicSpec`): no ciphertext, no
 * startup script or agent command in clear, whatever the event's age.
 */
export const vmsProjection: Projection = {
  name: 'vms',
  migrations: [
    {
      id: 'vms_0001',
      sql: `
        CREATE TABLE IF NOT EXISTS vms (
          id text PRIMARY KEY,
          tenant_id text NOT NULL,
          task_id text,
          state text NOT NULL,
          host_id text,
          url text,
          endpoints jsonb NOT NULL DEFAULT '[]',
          spec jsonb NOT NULL,
          placement jsonb,
          reason text,
          error text,
          error_code text,
          failed_phase text,
          boot_ms integer,
          idempotency_key text,
          revision bigint NOT NULL,
          created_at timestamptz NOT NULL,
          updated_at timestamptz NOT NULL,
          state_changed_at timestamptz NOT NULL,
          last_activity_at timestamptz NOT NULL
        );
        CREATE INDEX IF NOT EXISTS vms_tenant_created_idx ON vms (tenant_id, created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS vms_created_idx ON vms (created_at DESC, id DESC);
        CREATE INDEX IF NOT EXISTS vms_host_state_idx ON vms (host_id, state);
        CREATE INDEX IF NOT EXISTS vms_task_idx ON vms (task_id) WHERE task_id IS NOT NULL;
        CREATE INDEX IF NOT EXISTS vms_state_idx ON vms (state);`,
    },
    {
      // Rows written before sealing kept the startup script and agent command in clear: mask them as apply now does.
      id: 'vms_0002_sealed_spec',
      sql: `
        UPDATE vms SET spec = jsonb_set(spec, '{startup_script}', '"[sealed]"') WHERE spec ? 'startup_script' AND spec->>'startup_script' <> '[sealed]';
        UPDATE vms SET spec = jsonb_set(spec, '{agent,command}', '"[sealed]"') WHERE spec->'agent' ? 'command' AND spec->'agent'->>'command' <> '[sealed]';
        UPDATE vms SET spec = jsonb_set(spec, '{agent,drain_command}', '"[sealed]"') WHERE coalesce(spec->'agent'->>'drain_command', '') NOT IN ('', '[sealed]');
        UPDATE vms SET spec = spec - 'startup_script_encrypted' - 'secrets_encrypted' WHERE spec ?| array['startup_script_encrypted', 'secrets_encrypted'];
        UPDATE vms SET spec = jsonb_set(spec, '{agent}', (spec->'agent') - 'command_encrypted' - 'drain_command_encrypted') WHERE spec->'agent' ?| array['command_encrypted', 'drain_command_encrypted'];`,
    },
    {
      // Rows kept before the closed reason set read as a replay now reads their events (upgradeVmEventData);
      // an admin's old destroy stays `client` here until a rebuild, which reads the actor from the event metadata.
      id: 'vms_0003_lifecycle',
      sql: `
        ALTER TABLE vms ADD COLUMN IF NOT EXISTS metadata jsonb NOT NULL DEFAULT '{}';
        ALTER TABLE vms ADD COLUMN IF NOT EXISTS exit_code integer;
        ALTER TABLE vms ADD COLUMN IF NOT EXISTS timeout_at timestamptz;
        CREATE INDEX IF NOT EXISTS vms_metadata_idx ON vms USING gin (metadata jsonb_path_ops);
        CREATE INDEX IF NOT EXISTS vms_tenant_reason_idx ON vms (tenant_id, reason) WHERE reason IS NOT NULL;
        UPDATE vms SET reason = 'orphaned' WHERE reason IN ('placement', 'boot_failure') AND error_code = 'INTERRUPTED';
        UPDATE vms SET reason = CASE reason WHEN 'max_runtime' THEN 'timeout' WHEN 'stuck' THEN 'timeout' WHEN 'orphan' THEN 'orphaned'
          WHEN 'missing' THEN 'host_lost' ELSE 'error' END
          WHERE reason IN ('max_runtime', 'stuck', 'orphan', 'missing', 'boot_failure', 'placement', 'capacity');
        UPDATE vms SET error_code = 'UNKNOWN' WHERE state = 'failed' AND reason = 'error' AND error_code IS NULL;`,
    },
    {
      // No event before it carried a signal: nothing to backfill.
      id: 'vms_0004_exit_signal',
      sql: `ALTER TABLE vms ADD COLUMN IF NOT EXISTS exit_signal text;`,
    },
  ],
  tables: [{ name: 'vms', key: ['id'] }],
  apply: (sql: Sql, recorded: RecordedEvent) => applyVmEvents(sql, [recorded]),
  applyBatch: applyVmEvents,
};

interface VmRowState {
  id: string;
  tenant_id: string;
  task_id: string | null;
  state: string;
  host_id: string | null;
  url: string | null;
  endpoints: unknown;
  spec: unknown;
  placement: unknown;
  reason: string | null;
  error: string | null;
  error_code: string | null;
  failed_phase: string | null;
  boot_ms: number | null;
  idempotency_key: string | null;
  revision: string;
  created_at: Date;
  updated_at: Date;
  state_changed_at: Date;
  last_activity_at: Date;
  metadata: Record<string, string>;
  exit_code: number | null;
  exit_signal: string | null;
  timeout_at: string | null;
}

const COLUMNS: ReadonlyArray<[keyof VmRowState, string]> = [
  ['id', 'text'],
  ['tenant_id', 'text'],
  ['task_id', 'text'],
  ['state', 'text'],
  ['host_id', 'text'],
  ['url', 'text'],
  ['endpoints', 'jsonb'],
  ['spec', 'jsonb'],
  ['placement', 'jsonb'],
  ['reason', 'text'],
  ['error', 'text'],
  ['error_code', 'text'],
  ['failed_phase', 'text'],
  ['boot_ms', 'integer'],
  ['idempotency_key', 'text'],
  ['revision', 'bigint'],
  ['created_at', 'timestamptz'],
  ['updated_at', 'timestamptz'],
  ['state_changed_at', 'timestamptz'],
  ['last_activity_at', 'timestamptz'],
  ['metadata', 'jsonb'],
  ['exit_code', 'integer'],
  ['exit_signal', 'text'],
  ['timeout_at', 'timestamptz'],
];

/**
 * Load, fold, write: the rows a run of events touches are read once, every
 * event is folded into them in order in memory, and they are written back in
 * one statement. One event is the same code with a run of one, so a replay
 * (thousands per batch) and the live path cannot disagree. Only VMs whose
 * VmRequested has been applied have a row; events for any other are ignored,
 * as an UPDATE of a missing row would.
 */
async function applyVmEvents(sql: Sql, events: readonly RecordedEvent[]): Promise<void> {
  const vmEvents = events.filter((r) => r.streamId.startsWith('vm-') && isVmEventType(r.type)).map((r) => ({ r, e: parsedVmEvent(r) }));
  if (vmEvents.length === 0) return;
  const ids = [...new Set(vmEvents.map(({ e }) => e.data.vm_id))];
  const { rows } = await sql.query(`SELECT ${COLUMNS.map(([c]) => c).join(', ')} FROM vms WHERE id = ANY($1::text[])`, [ids]);
  const byId = new Map<string, VmRowState>(
    rows.map((row) => [row.id as string, { ...(row as unknown as VmRowState), revision: String(row.revision) }]),
  );
  const touched = new Set<string>();
  for (const { r, e } of vmEvents) {
    const id = e.data.vm_id;
    const at = r.created;
    if (e.type === 'VmRequested') {
      if (byId.has(id)) continue;
      const d = e.data;
      byId.set(id, {
        id,
        tenant_id: d.tenant_id,
        task_id: d.task_id ?? null,
        state: 'requested',
        host_id: null,
        url: null,
        endpoints: [],
        spec: publicSpec(d.spec),
        placement: null,
        reason: null,
        error: null,
        error_code: null,
        failed_phase: null,
        boot_ms: null,
        idempotency_key: d.idempotency_key ?? null,
        revision: r.revision.toString(),
        created_at: at,
        updated_at: at,
        state_changed_at: at,
        last_activity_at: at,
        metadata: d.metadata ?? {},
        exit_code: null,
        exit_signal: null,
        timeout_at: null,
      });
      touched.add(id);
      continue;
    }
    const row = byId.get(id);
    if (!row) continue;
    touched.add(id);
    row.revision = r.revision.toString();
    row.updated_at = at;
    switch (e.type) {
      case 'VmPlaced':
        Object.assign(row, { state: 'placed', host_id: e.data.host_id, placement: e.data.decision, state_changed_at: at });
        break;
      case 'VmBootStarted':
        Object.assign(row, { state: 'booting', state_changed_at: at });
        break;
      case 'VmBooted': {
        const maxRuntimeS = (row.spec as { max_runtime_s?: number }).max_runtime_s;
        Object.assign(row, {
          state: 'running',
          url: e.data.url,
          endpoints: e.data.endpoints,
          boot_ms: e.data.boot_ms,
          state_changed_at: at,
          last_activity_at: at,
          // The same deadline the decider folds: from the event's own time, so a replay agrees.
          timeout_at: maxRuntimeS ? new Date(Date.parse(e.data.at) + maxRuntimeS * 1000).toISOString() : null,
        });
        break;
      }
      case 'VmTimeoutSet':
        if (row.state === 'running') row.timeout_at = e.data.timeout_at;
        break;
      case 'VmMetadataSet':
        row.metadata = e.data.metadata;
        break;
      case 'VmActivityRecorded': {
        const activity = new Date(e.data.at);
        if (activity > row.last_activity_at) row.last_activity_at = activity;
        break;
      }
      case 'VmDestroyRequested':
        Object.assign(row, { state: 'destroying', reason: e.data.reason, state_changed_at: at });
        break;
      case 'VmDestroyed':
        Object.assign(row, { state: 'destroyed', reason: e.data.reason, state_changed_at: at });
        break;
      case 'VmMigrated':
        Object.assign(row, { host_id: e.data.host_id, placement: e.data.decision, url: e.data.url, endpoints: e.data.endpoints });
        break;
      case 'VmEgressChanged':
        row.spec = { ...(row.spec as Record<string, unknown>), egress: e.data.egress };
        break;
      case 'VmPaused':
        Object.assign(row, { state: 'paused', endpoints: [], state_changed_at: at });
        break;
      case 'VmResumed':
        // The deadline moves by the time spent paused (state_changed_at is when the pause landed).
        if (row.timeout_at && row.state === 'paused') {
          const pausedMs = Math.max(0, at.getTime() - new Date(row.state_changed_at).getTime());
          row.timeout_at = new Date(new Date(row.timeout_at).getTime() + pausedMs).toISOString();
        }
        Object.assign(row, {
          state: 'running',
          host_id: e.data.host_id,
          placement: e.data.decision,
          endpoints: e.data.endpoints,
          state_changed_at: at,
          last_activity_at: at,
        });
        break;
      case 'VmRestored':
        Object.assign(row, { endpoints: e.data.endpoints, last_activity_at: at });
        break;
      case 'VmFailed':
        Object.assign(row, {
          state: 'failed',
          reason: e.data.reason,
          error: e.data.error,
          error_code: e.data.error_code ?? null,
          failed_phase: e.data.phase,
          exit_code: e.data.exit_code ?? null,
          exit_signal: e.data.exit_signal ?? null,
          state_changed_at: at,
        });
        break;
    }
  }
  if (touched.size === 0) return;
  // Every touched id was set in `byId` above.
  const out = [...touched].flatMap((id) => byId.get(id) ?? []);
  const cols = COLUMNS.map(([c]) => c);
  // JSON null in a jsonb field of the record set is the jsonb value null, not SQL NULL: map it back.
  const select = COLUMNS.map(([c, t]) => (t === 'jsonb' ? `NULLIF(r.${c}, 'null'::jsonb)` : `r.${c}`)).join(', ');
  await sql.query(
    `INSERT INTO vms (${cols.join(', ')})
     SELECT ${select} FROM jsonb_to_recordset($1::jsonb) AS r(${COLUMNS.map(([c, t]) => `${c} ${t}`).join(', ')})
     ON CONFLICT (id) DO UPDATE SET ${cols
       .filter((c) => c !== 'id')
       .map((c) => `${c} = EXCLUDED.${c}`)
       .join(', ')}`,
    [JSON.stringify(out)],
  );
}
