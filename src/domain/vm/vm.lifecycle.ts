import { z } from 'zod';
import { ValidationError } from '@fleet/agent-protocol';

/**
 * Why a VM ended (or is ending): a closed set, the same in events, reads,
 * list filters, the feed and billing, so every end can be counted and
 * explained.
 *
 * - `client`: its tenant destroyed it; `admin`: the admin key did.
 * - `timeout`: its max runtime passed (`max_runtime_s`, a PATCHed `timeout_s`, or the fleet's TASK_STUCK_TIMEOUT_MS).
 * - `idle`: no activity for its idle timeout.
 * - `oom`: its init was killed for memory; `exited`: its init ended on its own (`exit_code`, or `exit_signal` for a
 *   signal death, when the host reported it).
 * - `host_lost`: its host was deregistered, or no longer has its sandbox.
 * - `orphaned`: the control plane that was creating it stopped part-way; the reconciler rolled it back.
 * - `error`: create failed (placement, capacity, boot, startup script): `phase` and `error_code` say where and what.
 * - `evicted`: the operator drained its host.
 */
export const vmEndReasonSchema = z.enum([
  'client',
  'admin',
  'timeout',
  'idle',
  'oom',
  'exited',
  'host_lost',
  'orphaned',
  'error',
  'evicted',
]);
export type VmEndReason = z.infer<typeof vmEndReasonSchema>;
export const VM_END_REASONS: readonly VmEndReason[] = vmEndReasonSchema.options;

/** Reasons that end a VM through a destroy the fleet asked for (VmDestroyRequested → VmDestroyed). */
export const DESTROY_REASONS = ['client', 'admin', 'idle', 'evicted'] as const satisfies readonly VmEndReason[];
export type DestroyReason = (typeof DESTROY_REASONS)[number];
/** Reasons that end a VM that stopped or went wrong on its own, or was cut off (VmFailed). */
export const FAIL_REASONS = ['timeout', 'oom', 'exited', 'host_lost', 'orphaned', 'error'] as const satisfies readonly VmEndReason[];
export type FailReason = (typeof FAIL_REASONS)[number];

/** What a VmFailed must carry beside its reason, checked by the decider so no end is recorded half-explained. */
export interface EndDetails {
  readonly error_code?: string | undefined;
  readonly exit_code?: number | undefined;
  readonly exit_signal?: string | undefined;
}

/** Throws VALIDATION_FAILED (a bug in the caller, surfaced) unless `reason` may end a VM this way with these details. */
export function assertEndReason(reason: unknown, how: 'destroy' | 'fail', details: EndDetails = {}): asserts reason is VmEndReason {
  const allowed: readonly string[] = how === 'destroy' ? DESTROY_REASONS : FAIL_REASONS;
  if (typeof reason !== 'string' || !allowed.includes(reason)) {
    throw new ValidationError(`a VM ${how === 'destroy' ? 'destroy' : 'failure'} needs a reason, one of ${allowed.join(', ')}`, [
      { path: 'reason', message: `got ${JSON.stringify(reason)}` },
    ]);
  }
  if (reason === 'error' && !details.error_code)
    throw new ValidationError('a VM that ends with reason error needs the error code', [{ path: 'error_code', message: 'missing' }]);
  if ((details.exit_code !== undefined || details.exit_signal !== undefined) && reason !== 'exited' && reason !== 'oom')
    throw new ValidationError('only an init that ended (exited, oom) has an exit code or signal', [
      { path: details.exit_code !== undefined ? 'exit_code' : 'exit_signal', message: 'unexpected' },
    ]);
  if (details.exit_code !== undefined && details.exit_signal !== undefined)
    throw new ValidationError('an init ended with an exit code or of a signal, not both', [{ path: 'exit_signal', message: 'unexpected' }]);
}

/**
 * Reasons written before the closed set existed, and what they read as.
 * `client` written by the admin key reads `admin`; a `placement` or
 * `boot_failure` with error code INTERRUPTED was the reconciler rolling back
 * a create its control plane abandoned, so it reads `orphaned`.
 */
const LEGACY_REASONS: Readonly<Record<string, VmEndReason>> = {
  max_runtime: 'timeout',
  stuck: 'timeout',
  orphan: 'orphaned',
  boot_failure: 'error',
  missing: 'host_lost',
  placement: 'error',
  capacity: 'error',
};

const ENDING_TYPES = new Set(['VmDestroyRequested', 'VmDestroyed', 'VmFailed']);

/**
 * Upgrades the data of a VM event written before the closed reason set on
 * read (events are never rewritten): old reasons map as LEGACY_REASONS says,
 * and an old error without a code gets `UNKNOWN`. New events pass unchanged.
 */
export function upgradeVmEventData(type: string, data: unknown, meta?: { readonly actor?: string | undefined }): unknown {
  if (!ENDING_TYPES.has(type) || data === null || typeof data !== 'object') return data;
  const d = data as Record<string, unknown>;
  const reason = d.reason;
  if (typeof reason !== 'string') return data;
  let upgraded: string = reason;
  if (reason === 'client' && meta?.actor === 'admin') upgraded = 'admin';
  else if ((reason === 'placement' || reason === 'boot_failure') && d.error_code === 'INTERRUPTED') upgraded = 'orphaned';
  else upgraded = LEGACY_REASONS[reason] ?? reason;
  if (upgraded === reason) return data;
  const out: Record<string, unknown> = { ...d, reason: upgraded };
  if (type === 'VmFailed' && upgraded === 'error' && typeof d.error_code !== 'string') out.error_code = 'UNKNOWN';
  return out;
}

/** Caller metadata of a VM: a small string map, returned everywhere and filterable. */
export const METADATA_LIMITS = { maxKeys: 64, maxKeyLength: 128, maxValueLength: 512 } as const;
export const metadataKeySchema = z
  .string()
  .regex(
    /^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$/,
    'a metadata key: letters, digits and ._/-, starting with a letter or digit, up to 128 characters',
  );
export const metadataSchema = z
  .record(
    metadataKeySchema,
    z.string().max(METADATA_LIMITS.maxValueLength, `a metadata value is at most ${METADATA_LIMITS.maxValueLength} characters`),
  )
  .refine((m) => Object.keys(m).length <= METADATA_LIMITS.maxKeys, `at most ${METADATA_LIMITS.maxKeys} metadata keys`);
export type VmMetadata = z.infer<typeof metadataSchema>;

/** `PATCH /v1/vms/:id` timeout: seconds from now, at most a year. */
export const MAX_TIMEOUT_S = 365 * 24 * 3600;
export const timeoutSecondsSchema = z
  .number()
  .int()
  .min(1, 'timeout_s is at least 1 second')
  .max(MAX_TIMEOUT_S, `timeout_s is at most ${MAX_TIMEOUT_S} (a year)`);

/** Parses `key=value` (the list filter); the value may itself contain `=`. */
export function parseMetadataFilter(raw: string): [string, string] | undefined {
  const i = raw.indexOf('=');
  if (i <= 0) return undefined;
  const key = raw.slice(0, i);
  return metadataKeySchema.safeParse(key).success ? [key, raw.slice(i + 1)] : undefined;
}

/** The reason and exit code a sandbox whose init ended is recorded with, from what its host reports. */
export function endOfStoppedSandbox(report: StoppedSandboxReport): {
  reason: 'oom' | 'exited';
  exit_code: number | undefined;
  exit_signal: string | undefined;
  error_code: string;
} {
  const how = { exit_code: report.exit_code, exit_signal: report.exit_code === undefined ? report.exit_signal : undefined };
  if (report.oom_killed) return { reason: 'oom', ...how, error_code: 'OOM_KILLED' };
  return { reason: 'exited', ...how, error_code: 'SANDBOX_EXITED' };
}

/** What a host says of a listed sandbox whose init is no longer running (what it knows of it). */
export interface StoppedSandboxReport {
  readonly exit_code?: number | undefined;
  readonly exit_signal?: string | undefined;
  readonly oom_killed?: boolean | undefined;
}
