import { z } from 'zod';
import { parseStoredEvent } from '../stored-event.js';
import { reservationSchema } from '../host/host.events.js';
import { idSchema } from '../ids.js';
import { placementDecisionSchema } from '../placement/placement.js';
import { egressSpecSchema } from '@fleet/agent-protocol';
import { protocolSchema, storedVmSpecSchema } from './spec.js';
import { metadataSchema, upgradeVmEventData, vmEndReasonSchema } from './vm.lifecycle.js';

export { vmEndReasonSchema, type VmEndReason } from './vm.lifecycle.js';

export const vmStatusSchema = z.enum(['requested', 'placed', 'booting', 'running', 'paused', 'destroying', 'destroyed', 'failed']);
export type VmStatus = z.infer<typeof vmStatusSchema>;

/** Where a failed VM stopped: the non-terminal state it was in. */
export const vmPhaseSchema = z.enum(['requested', 'placed', 'booting', 'running', 'paused', 'destroying']);
export type VmPhase = z.infer<typeof vmPhaseSchema>;

export const endpointSchema = z.object({
  as: z.string(),
  url: z.string(),
  port: z.number().int().min(1).max(65535),
  /** What the agent actually published on; absent reads as tcp. */
  protocol: protocolSchema.optional(),
});
export type Endpoint = z.infer<typeof endpointSchema>;

/** A host reservation as the VM remembers it: enough to release it, and the uuids it is bound to. */
export const vmReservationSchema = reservationSchema.omit({ vm_id: true });
export type VmReservation = z.infer<typeof vmReservationSchema>;

const at = z.iso.datetime({ offset: true });

export const vmRequestedSchema = z.object({
  type: z.literal('VmRequested'),
  data: z.object({
    vm_id: idSchema,
    /** File contents stripped (see storedVmSpecSchema). */
    spec: storedVmSpecSchema,
    tenant_id: z.string().min(1),
    task_id: z.string().optional(),
    idempotency_key: z.string().optional(),
    /** Caller metadata given at create (absent: none); replaced later by VmMetadataSet. */
    metadata: metadataSchema.optional(),
    at,
  }),
});

export const vmPlacedSchema = z.object({
  type: z.literal('VmPlaced'),
  data: z.object({
    vm_id: idSchema,
    host_id: idSchema,
    decision: placementDecisionSchema,
    reservation: vmReservationSchema,
    at,
  }),
});

export const vmBootStartedSchema = z.object({
  type: z.literal('VmBootStarted'),
  data: z.object({ vm_id: idSchema, host_id: idSchema, at }),
});

export const vmBootedSchema = z.object({
  type: z.literal('VmBooted'),
  data: z.object({
    vm_id: idSchema,
    url: z.string(),
    endpoints: z.array(endpointSchema),
    boot_ms: z.number().int().nonnegative(),
    /** AES-256-GCM ciphertext of the per-VM token; never the clear token. */
    auth_token_encrypted: z.string().optional(),
    at,
  }),
});

export const vmActivityRecordedSchema = z.object({
  type: z.literal('VmActivityRecorded'),
  data: z.object({ vm_id: idSchema, at }),
});

export const vmDestroyRequestedSchema = z.object({
  type: z.literal('VmDestroyRequested'),
  data: z.object({ vm_id: idSchema, reason: vmEndReasonSchema, at }),
});

export const vmDestroyedSchema = z.object({
  type: z.literal('VmDestroyed'),
  data: z.object({ vm_id: idSchema, reason: vmEndReasonSchema, at }),
});

export const vmFailedSchema = z.object({
  type: z.literal('VmFailed'),
  data: z.object({
    vm_id: idSchema,
    reason: vmEndReasonSchema,
    error: z.string(),
    /** Stable code of the error that ended it, when there was one (e.g. AGENT_UNAVAILABLE); always set for reason `error`. */
    error_code: z.string().optional(),
    phase: vmPhaseSchema,
    /** For `exited` and `oom`: the init's exit code, when its host reported it. */
    exit_code: z.number().int().optional(),
    /** For `exited` and `oom`: the signal that killed the init instead (e.g. SIGKILL), when its host reported it. */
    exit_signal: z.string().optional(),
    at,
  }),
});

/** A cold migration finished: the VM, same id, now runs on `host_id` (booted from `snapshot_id`). */
export const vmMigratedSchema = z.object({
  type: z.literal('VmMigrated'),
  data: z.object({
    vm_id: idSchema,
    from_host_id: idSchema,
    host_id: idSchema,
    decision: placementDecisionSchema,
    reservation: vmReservationSchema,
    snapshot_id: z.string(),
    url: z.string(),
    endpoints: z.array(endpointSchema),
    at,
  }),
});

/** The VM's max runtime set from now on (`PATCH timeout_s`): it ends with reason `timeout` at `timeout_at`. */
export const vmTimeoutSetSchema = z.object({
  type: z.literal('VmTimeoutSet'),
  data: z.object({ vm_id: idSchema, timeout_s: z.number().int().positive(), timeout_at: at, at }),
});

/** The VM's caller metadata replaced as a whole. */
export const vmMetadataSetSchema = z.object({
  type: z.literal('VmMetadataSet'),
  data: z.object({ vm_id: idSchema, metadata: metadataSchema, at }),
});

/**
 * An OOM kill inside the sandbox, reported by its host's monitor; the VM may
 * well survive it (the kill was of a command, not of its init). `count` is
 * the sandbox's cumulative kill count after this one, which makes the
 * report idempotent: a count already recorded is not recorded again.
 */
export const vmOomKilledSchema = z.object({
  type: z.literal('VmOomKilled'),
  data: z.object({
    vm_id: idSchema,
    /** Command name of the killed process ("unknown" when the host could not tell: e.g. killed while its agent was down). */
    process: z.string(),
    /** Pid inside the sandbox, when known (1: its init). */
    pid: z.number().int().positive().optional(),
    limit_mb: z.number().int().nonnegative(),
    count: z.number().int().positive(),
    at,
  }),
});

/** Its processes were checkpointed (memory included) and stopped on its host; CPU and memory released, its disk kept there. */
export const vmPausedSchema = z.object({
  type: z.literal('VmPaused'),
  data: z.object({
    vm_id: idSchema,
    host_id: idSchema,
    /** The host's checkpoint the processes are in. */
    checkpoint_id: z.string(),
    /** How long the guest was frozen before it stopped, as the agent measured it. */
    pause_ms: z.number().int().nonnegative(),
    at,
  }),
});

/** A running VM's outbound policy was replaced (PUT /v1/vms/:id/network); its host applied it first. */
export const vmEgressChangedSchema = z.object({
  type: z.literal('VmEgressChanged'),
  data: z.object({ vm_id: idSchema, egress: egressSpecSchema, at }),
});

/**
 * The VM's egress provider failed an operation on its endpoint (the seed's
 * EgressMetrics): what feeds fleet_egress_failures_total{provider,op}. Only
 * `provision` exists: the agent's own proxy has no endpoint of its own to
 * tear down (a sandbox's proxy policy goes with it), so `teardown` is added
 * (additively) with the first provider that has one. The VM's own end, if
 * the failure ended it, is its VmFailed.
 */
export const vmEgressFailedSchema = z.object({
  type: z.literal('VmEgressFailed'),
  data: z.object({ vm_id: idSchema, provider: z.string(), op: z.enum(['provision']), error: z.string(), at }),
});

/** Its processes run again where they stopped, on `host_id` with a new reservation. */
export const vmResumedSchema = z.object({
  type: z.literal('VmResumed'),
  data: z.object({
    vm_id: idSchema,
    host_id: idSchema,
    decision: placementDecisionSchema,
    reservation: vmReservationSchema,
    endpoints: z.array(endpointSchema),
    resume_ms: z.number().int().nonnegative(),
    at,
  }),
});

/** Put back to one of its own snapshots on its host (a live one: its processes too); it runs on. */
export const vmRestoredSchema = z.object({
  type: z.literal('VmRestored'),
  data: z.object({
    vm_id: idSchema,
    snapshot_id: z.string(),
    kind: z.enum(['disk', 'live']),
    endpoints: z.array(endpointSchema),
    restore_ms: z.number().int().nonnegative(),
    at,
  }),
});

export const vmEventSchema = z.discriminatedUnion('type', [
  vmRequestedSchema,
  vmPlacedSchema,
  vmBootStartedSchema,
  vmBootedSchema,
  vmActivityRecordedSchema,
  vmDestroyRequestedSchema,
  vmDestroyedSchema,
  vmFailedSchema,
  vmMigratedSchema,
  vmTimeoutSetSchema,
  vmMetadataSetSchema,
  vmOomKilledSchema,
  vmEgressChangedSchema,
  vmEgressFailedSchema,
  vmPausedSchema,
  vmResumedSchema,
  vmRestoredSchema,
]);
export type VmEvent = z.infer<typeof vmEventSchema>;
export type VmEventType = VmEvent['type'];
export const VM_EVENT_TYPES: readonly VmEventType[] = vmEventSchema.options.map((o) => o.shape.type.value);

export type VmRequested = z.infer<typeof vmRequestedSchema>;
export type VmPlaced = z.infer<typeof vmPlacedSchema>;
export type VmBootStarted = z.infer<typeof vmBootStartedSchema>;
export type VmBooted = z.infer<typeof vmBootedSchema>;
export type VmActivityRecorded = z.infer<typeof vmActivityRecordedSchema>;
export type VmDestroyRequested = z.infer<typeof vmDestroyRequestedSchema>;
export type VmDestroyed = z.infer<typeof vmDestroyedSchema>;
export type VmFailed = z.infer<typeof vmFailedSchema>;
export type VmMigrated = z.infer<typeof vmMigratedSchema>;
export type VmTimeoutSet = z.infer<typeof vmTimeoutSetSchema>;
export type VmMetadataSet = z.infer<typeof vmMetadataSetSchema>;
export type VmOomKilled = z.infer<typeof vmOomKilledSchema>;
export type VmEgressChanged = z.infer<typeof vmEgressChangedSchema>;
export type VmEgressFailed = z.infer<typeof vmEgressFailedSchema>;
export type VmPaused = z.infer<typeof vmPausedSchema>;
export type VmResumed = z.infer<typeof vmResumedSchema>;

/**
 * Parses a stored event back into a typed VM event; `STORED_EVENT_INVALID`
 * (500) when it does not match. Events written before the closed reason set
 * are upgraded on read (see upgradeVmEventData); pass the event's metadata
 * so an admin's old destroy reads `admin`.
 */
export function parseVmEvent(type: string, data: unknown, meta?: { readonly actor?: string | undefined }): VmEvent {
  return parseStoredEvent(vmEventSchema, type, upgradeVmEventData(type, data, meta));
}

export function isVmEventType(type: string): type is VmEventType {
  return (VM_EVENT_TYPES as readonly string[]).includes(type);
}
