import type { Aggregate } from '../aggregate.js';
import { assertNever, type DecideContext, type Decider } from '../decider.js';
import type { RecordedEvent } from '../event-store.port.js';
import { isResumeClaimEventType, parseResumeClaimEvent, VM_RESUME_STREAM_PREFIX, type ResumeClaimEvent } from './resume-claim.events.js';

export interface ResumeClaimState {
  /** The open claim, if any (ended claims are forgotten). */
  readonly claim: { readonly claim_id: string; readonly until: string } | undefined;
}

export type ResumeClaimCommand =
  | { readonly type: 'ClaimResume'; readonly data: { readonly vm_id: string; readonly claim_id: string; readonly lease_ms: number } }
  | { readonly type: 'RenewResumeClaim'; readonly data: { readonly vm_id: string; readonly claim_id: string; readonly lease_ms: number } }
  | {
      readonly type: 'EndResumeClaim';
      readonly data: { readonly vm_id: string; readonly claim_id: string; readonly outcome: 'resumed' | 'failed' | 'not_needed' };
    };

/**
 * A claim is granted when none is open or the open one is past its lease; the caller reads the state to know whether it holds it
 * (claiming again while holding it is a no-op). Its holder renews it (RenewResumeClaim): once half its lease has passed, the
 * lease starts anew. A renewal never grants: of a claim that ended, or that another holds, it is a no-op (the caller reads that
 * it lost its claim).
 */
export function decideResumeClaim(command: ResumeClaimCommand, state: ResumeClaimState, ctx: DecideContext): ResumeClaimEvent[] {
  const at = ctx.now.toISOString();
  switch (command.type) {
    case 'ClaimResume': {
      const d = command.data;
      if (state.claim && (state.claim.claim_id === d.claim_id || Date.parse(state.claim.until) > ctx.now.getTime())) return [];
      const until = new Date(ctx.now.getTime() + d.lease_ms).toISOString();
      return [{ type: 'VmResumeClaimed', data: { vm_id: d.vm_id, claim_id: d.claim_id, until, at } }];
    }
    case 'RenewResumeClaim': {
      const d = command.data;
      if (state.claim?.claim_id !== d.claim_id || Date.parse(state.claim.until) - ctx.now.getTime() > d.lease_ms / 2) return [];
      const until = new Date(ctx.now.getTime() + d.lease_ms).toISOString();
      return [{ type: 'VmResumeClaimed', data: { vm_id: d.vm_id, claim_id: d.claim_id, until, at } }];
    }
    case 'EndResumeClaim': {
      const d = command.data;
      if (state.claim?.claim_id !== d.claim_id) return [];
      return [{ type: 'VmResumeClaimEnded', data: { vm_id: d.vm_id, claim_id: d.claim_id, outcome: d.outcome, at } }];
    }
    default:
      return assertNever(command, 'resume claim command');
  }
}

export function evolveResumeClaim(state: ResumeClaimState, event: ResumeClaimEvent): ResumeClaimState {
  switch (event.type) {
    case 'VmResumeClaimed':
      return { claim: { claim_id: event.data.claim_id, until: event.data.until } };
    case 'VmResumeClaimEnded':
      return state.claim?.claim_id === event.data.claim_id ? { claim: undefined } : state;
    default:
      return assertNever(event, 'resume claim event');
  }
}

export const resumeClaimDecider: Decider<ResumeClaimCommand, ResumeClaimEvent, ResumeClaimState> = {
  decide: decideResumeClaim,
  evolve: evolveResumeClaim,
  initialState: { claim: undefined },
};

export function decodeResumeClaimEvent(r: RecordedEvent): ResumeClaimEvent | undefined {
  return isResumeClaimEventType(r.type) ? parseResumeClaimEvent(r.type, r.data) : undefined;
}

export const resumeClaimAggregate: Aggregate<ResumeClaimCommand, ResumeClaimEvent, ResumeClaimState> = {
  streamName: (vmId) => VM_RESUME_STREAM_PREFIX + vmId,
  decode: decodeResumeClaimEvent,
  decider: resumeClaimDecider,
};
