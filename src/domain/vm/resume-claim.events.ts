import { z } from 'zod';
import { idSchema } from '../ids.js';
import { parseStoredEvent } from '../stored-event.js';

/**
 * Who is resuming a paused VM, on a `vmresume-<vm id>` stream of its own:
 * the claim is appended at the revision it was decided on, so of two
 * control-plane replicas resuming at once exactly one restores, and the
 * other waits for the VM it made running instead of restoring a second copy
 * (on another host when the origin looks full to it) or moving a
 * checkpoint the winner has already consumed.
 */
export const VM_RESUME_STREAM_PREFIX = 'vmresume-';

const at = z.iso.datetime({ offset: true });

export const resumeClaimedSchema = z.object({
  type: z.literal('VmResumeClaimed'),
  data: z.object({
    vm_id: idSchema,
    claim_id: z.string().regex(/^[A-Za-z0-9_-]{1,64}$/),
    /** Another replica may claim after this (the claimant died mid-resume). */
    until: at,
    at,
  }),
});

export const resumeClaimEndedSchema = z.object({
  type: z.literal('VmResumeClaimEnded'),
  data: z.object({
    vm_id: idSchema,
    claim_id: z.string().regex(/^[A-Za-z0-9_-]{1,64}$/),
    outcome: z.enum(['resumed', 'failed', 'not_needed']),
    at,
  }),
});

export const resumeClaimEventSchema = z.discriminatedUnion('type', [resumeClaimedSchema, resumeClaimEndedSchema]);
export type ResumeClaimEvent = z.infer<typeof resumeClaimEventSchema>;

export function isResumeClaimEventType(type: string): type is ResumeClaimEvent['type'] {
  return type === 'VmResumeClaimed' || type === 'VmResumeClaimEnded';
}

export function parseResumeClaimEvent(type: string, data: unknown): ResumeClaimEvent {
  return parseStoredEvent(resumeClaimEventSchema, type, data);
}
