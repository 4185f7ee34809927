import { z } from 'zod';
import { ValidationError } from '@fleet/agent-protocol';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import { parseMetadataFilter, vmEndReasonSchema } from '../../domain/vm/vm.lifecycle.js';
import type { VmRow } from '../../projections/vms/vms.queries.js';

/** The lifecycle fields of a VM as reads show it, beside vms.routes.ts' own (spread into its schema and mappers). */
export const vmLifecycleFields = {
  metadata: z.record(z.string(), z.string()),
  /** Last activity that counts for idle expiry (exec, attach, file transfers; see docs/api.md). */
  last_activity_at: z.string(),
  /** The state a failed VM was in when it ended. */
  phase: z.string().nullable(),
  /** For `exited` and `oom`: the init's exit code, when its host reported it. */
  exit_code: z.number().nullable(),
  /** For `exited` and `oom`: the signal that killed the init instead of an exit (e.g. SIGKILL), when its host reported it. */
  exit_signal: z.string().nullable(),
  /** When a running VM ends with reason `timeout` (null: only the fleet's ceiling applies). */
  timeout_at: z.string().nullable(),
};

type LifecycleOut = { [K in keyof typeof vmLifecycleFields]: z.infer<(typeof vmLifecycleFields)[K]> };

export function lifecycleOfRow(r: VmRow): LifecycleOut {
  return {
    metadata: r.metadata,
    last_activity_at: r.last_activity_at,
    phase: r.failed_phase,
    exit_code: r.exit_code,
    exit_signal: r.exit_signal,
    timeout_at: r.state === 'running' ? r.timeout_at : null,
  };
}

export function lifecycleOfState(s: ExistingVmState): LifecycleOut {
  return {
    metadata: { ...s.metadata },
    last_activity_at: s.last_activity_at,
    phase: s.status === 'failed' ? s.phase : null,
    exit_code: s.status === 'failed' ? (s.exit_code ?? null) : null,
    exit_signal: s.status === 'failed' ? (s.exit_signal ?? null) : null,
    timeout_at: s.status === 'running' ? (s.timeout_at ?? null) : null,
  };
}

/** Extra filters of `GET /v1/vms`: `reason=` one of the closed set, `metadata=key=value` (repeat for AND). */
export const vmLifecycleListQuery = {
  reason: vmEndReasonSchema.optional(),
  metadata: z.union([z.string().max(1024), z.array(z.string().max(1024)).max(16)]).optional(),
};

export function metadataFilter(raw: string | readonly string[] | undefined): Record<string, string> | undefined {
  if (raw === undefined) return undefined;
  const out: Record<string, string> = {};
  for (const item of typeof raw === 'string' ? [raw] : raw) {
    const pair = parseMetadataFilter(item);
    if (!pair)
      throw new ValidationError(`metadata filter ${JSON.stringify(item)} must be key=value with a metadata key (letters, digits, ._/-)`, [
        { path: 'querystring.metadata', message: 'not key=value' },
      ]);
    if (pair[0] in out && out[pair[0]] !== pair[1])
      throw new ValidationError(`metadata key ${pair[0]} is filtered on twice with different values: no VM can match`, [
        { path: 'querystring.metadata', message: 'conflicting values' },
      ]);
    out[pair[0]] = pair[1];
  }
  return out;
}
