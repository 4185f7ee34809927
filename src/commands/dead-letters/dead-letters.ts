import { createHash } from 'node:crypto';
import type { Logger } from 'pino';
import { deadLetterAggregate } from '../../domain/deadletter/deadletter.aggregate.js';
import type { DeadLetterCommand, DeadLetterState } from '../../domain/deadletter/deadletter.decider.js';
import { AppError } from '@fleet/agent-protocol';
import type { HostAgent } from '../../domain/host-agent.port.js';
import { isValidId } from '../../domain/ids.js';
import { isTerminal, type VmState } from '../../domain/vm/vm.decider.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import { errInfo, type ReconcileSummary } from '../reconcile/reconcile-types.js';
import { SANDBOX_PREFIX } from '../vm/boot-sandbox.js';
import type { Actor } from '../vm/vm-commands.js';

/** The id of the dead letter for one (kind, host, entity): stable, so a recurring failure is one record. */
export function deadLetterId(kind: string, hostId: string, entity: string): string {
  return createHash('sha256').update(`${kind}\0${hostId}\0${entity}`).digest('hex').slice(0, 24);
}

interface Failure {
  count: number;
  firstAt: string;
  lastError: string;
  lastCode: string | undefined;
}

export interface DeadLetterConfig {
  readonly orphanDestroyMaxRetries: number;
  readonly agentTimeoutMs: number;
}

/**
 * Orphan destroys that keep failing, and what an operator does about them:
 * consecutive failures dead-letter the sandbox, which is then skipped until
 * it is retried (and resolved) or discarded.
 */
export class DeadLetters {
  private readonly orphanFailures = new Map<string, Failure>();
  private readonly deadLetterHandler: BoundOf<typeof deadLetterAggregate>;

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly loadVm: (vmId: string) => Promise<VmState>,
    private readonly config: DeadLetterConfig,
    private readonly logger: Logger,
    private readonly clock: () => Date,
  ) {
    this.deadLetterHandler = bindAggregate(handler, deadLetterAggregate);
  }

  /** Destroys an orphan sandbox; returns true when it is gone. Consecutive failures dead-letter it; a dead letter is skipped until an operator acts. */
  async destroyOrphan(
    hostId: string,
    agent: HostAgent,
    name: string,
    vmId: string | undefined,
    s: ReconcileSummary,
    actor: Actor,
  ): Promise<boolean> {
    const key = `${hostId}/${name}`;
    const id = deadLetterId('orphan_destroy', hostId, name);
    const letter = await this.loadDeadLetter(id);
    if (letter.status === 'open' || letter.status === 'discarded') {
      s.orphans_skipped++;
      return false;
    }
    try {
      await agent.destroyVm(name, { force: true, timeoutMs: this.config.agentTimeoutMs });
      this.orphanFailures.delete(key);
      s.orphans_destroyed++;
      this.logger.info({ host_id: hostId, sandbox: name, vm_id: vmId }, 'orphan sandbox destroyed');
      if (letter.status === 'retrying')
        await this.runDeadLetter(id, { type: 'ResolveDeadLetter', data: { id, outcome: 'succeeded' } }, actor);
      return true;
    } catch (err) {
      s.orphans_failed++;
      const prev = this.orphanFailures.get(key);
      const f: Failure = {
        count: (prev?.count ?? 0) + 1,
        firstAt: prev?.firstAt ?? this.clock().toISOString(),
        lastError: (err as Error).message,
        lastCode: err instanceof AppError ? err.code : undefined,
      };
      this.orphanFailures.set(key, f);
      this.logger.warn({ host_id: hostId, sandbox: name, failures: f.count, err: errInfo(err) }, 'orphan destroy failed');
      if (f.count >= this.config.orphanDestroyMaxRetries) {
        await this.runDeadLetter(
          id,
          {
            type: 'RecordDeadLetter',
            data: {
              id,
              kind: 'orphan_destroy',
              entity_id: name,
              host_id: hostId,
              vm_id: vmId,
              reason: f.lastError,
              error_code: f.lastCode,
              retry_count: f.count,
              first_failed_at: f.firstAt,
            },
          },
          actor,
        );
        this.orphanFailures.delete(key);
        s.orphans_dead_lettered++;
        this.logger.error(
          { host_id: hostId, sandbox: name, dead_letter: id, failures: f.count },
          'orphan destroy dead-lettered: skipped until an operator retries or discards it',
        );
      }
      return false;
    }
  }

  /**
   * An operator's retry: marks the dead letter retrying, then tries the work
   * at once. Success resolves it; failure leaves it retrying, and the
   * reconciler keeps trying (and dead-letters it again after the same count).
   */
  async retry(id: string, meta: CommandMeta): Promise<{ state: DeadLetterState; error?: { code: string; message: string } }> {
    const retried = await this.deadLetterHandler.handle(id, { type: 'RetryDeadLetter', data: { id, actor: meta.actor } }, meta);
    const letter = retried.state;
    if (letter.status !== 'retrying') return { state: letter };
    for (const key of this.orphanFailures.keys()) if (key === `${letter.host_id}/${letter.entity_id}`) this.orphanFailures.delete(key);
    try {
      const vmId = letter.entity_id.startsWith(SANDBOX_PREFIX) ? letter.entity_id.slice(SANDBOX_PREFIX.length) : undefined;
      if (vmId && isValidId(vmId)) {
        const vm = await this.loadVm(vmId);
        if (vm.status !== 'initial' && !isTerminal(vm.status) && vm.host_id === letter.host_id) {
          // The sandbox belongs to a live VM after all: nothing to destroy.
          const r = await this.deadLetterHandler.handle(id, { type: 'ResolveDeadLetter', data: { id, outcome: 'gone' } }, meta);
          return { state: r.state };
        }
      }
      const agent = await this.hosts.agentFor(letter.host_id);
      const res = await agent.destroyVm(letter.entity_id, { force: true, timeoutMs: this.config.agentTimeoutMs });
      const r = await this.deadLetterHandler.handle(
        id,
        { type: 'ResolveDeadLetter', data: { id, outcome: res.destroyed ? 'succeeded' : 'gone' } },
        meta,
      );
      this.logger.info({ dead_letter: id, host_id: letter.host_id, sandbox: letter.entity_id }, 'dead letter retried: resolved');
      return { state: r.state };
    } catch (err) {
      this.logger.warn({ dead_letter: id, err: errInfo(err) }, 'dead letter retry failed; the reconciler keeps retrying');
      return { state: letter, error: { code: err instanceof AppError ? err.code : 'INTERNAL', message: (err as Error).message } };
    }
  }

  async discard(id: string, note: string | undefined, meta: CommandMeta): Promise<DeadLetterState> {
    const r = await this.deadLetterHandler.handle(id, { type: 'DiscardDeadLetter', data: { id, actor: meta.actor, note } }, meta);
    return r.state;
  }

  private async loadDeadLetter(id: string): Promise<DeadLetterState> {
    return (await this.deadLetterHandler.load(id)).state;
  }

  private async runDeadLetter(id: string, command: DeadLetterCommand, meta: CommandMeta): Promise<void> {
    await this.deadLetterHandler.handle(id, command, meta);
  }
}
