import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { resumeClaimAggregate } from '../../domain/vm/resume-claim.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler } from '../command-handler.js';
import type { Actor } from './vm-commands.js';

/**
 * A replica that dies mid-resume holds the VM's resumes this long at most;
 * a live one renews its claim every third of it, however long its resume
 * takes (a checkpoint moved to another host).
 */
export const RESUME_CLAIM_LEASE_MS = 60_000;

/**
 * One resume of a paused VM across control-plane replicas (resume-claim.events.ts).
 * The in-process queue already serializes callers of one replica; this
 * serializes replicas, through the claim's expected revision.
 */
export class ResumeClaims {
  private readonly handler: BoundOf<typeof resumeClaimAggregate>;

  constructor(
    handler: CommandHandler,
    private readonly leaseMs = RESUME_CLAIM_LEASE_MS,
    private readonly pollMs = 100,
    private readonly logger?: Logger,
  ) {
    this.handler = bindAggregate(handler, resumeClaimAggregate);
  }

  /**
   * Runs `resume` holding the VM's claim. While another replica holds it,
   * waits: `settled` answers once the VM is no longer paused (what that
   * replica made of it), and a claim that ends without that (its resume
   * failed) or outlives its lease is claimed here. `settled` is asked again
   * once the claim is held: a resume that finished between the caller's read
   * and this claim must not be done twice.
   */
  async run<T>(vmId: string, actor: Actor, resume: () => Promise<T>, settled: () => Promise<T | undefined>): Promise<T> {
    const claimId = randomBytes(8).toString('hex');
    for (;;) {
      const claimed = await this.handler.handle(
        vmId,
        { type: 'ClaimResume', data: { vm_id: vmId, claim_id: claimId, lease_ms: this.leaseMs } },
        actor,
      );
      if (claimed.state.claim?.claim_id === claimId) break;
      for (;;) {
        const done = await settled();
        if (done !== undefined) return done;
        const { state } = await this.handler.load(vmId);
        if (!state.claim || Date.parse(state.claim.until) <= Date.now()) break;
        await new Promise((r) => setTimeout(r, this.pollMs));
      }
    }
    // One renewal at a time; `end` waits for the one in flight, so none lands after the claim ended.
    let renewing: Promise<void> = Promise.resolve();
    const renew = setInterval(() => {
      renewing = renewing.then(async () => {
        try {
          const r = await this.handler.handle(
            vmId,
            { type: 'RenewResumeClaim', data: { vm_id: vmId, claim_id: claimId, lease_ms: this.leaseMs } },
            actor,
          );
          if (r.state.claim?.claim_id !== claimId)
            this.logger?.warn({ vm_id: vmId }, 'resume claim lost (not renewed within its lease): another replica may resume too');
        } catch (err) {
          // The next tick tries again; a lease that runs out meanwhile is what the lease is for.
          this.logger?.warn({ vm_id: vmId, err: { message: (err as Error).message } }, 'resume claim not renewed');
        }
      });
    }, this.leaseMs / 3);
    const end = async (outcome: 'resumed' | 'failed' | 'not_needed'): Promise<void> => {
      clearInterval(renew);
      await renewing;
      await this.handler
        .handle(vmId, { type: 'EndResumeClaim', data: { vm_id: vmId, claim_id: claimId, outcome } }, actor)
        .catch(() => undefined);
    };
    let out: T | undefined;
    try {
      out = await settled();
      if (out !== undefined) {
        await end('not_needed');
        return out;
      }
      out = await resume();
    } catch (err) {
      await end('failed');
      throw err;
    }
    await end('resumed');
    return out;
  }
}
