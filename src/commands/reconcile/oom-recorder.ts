import type { Logger } from 'pino';
import type { VmInfo } from '@fleet/agent-protocol';
import type { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { BoundOf } from '../command-handler.js';
import { sandboxName, type Actor } from '../vm/vm-commands.js';
import type { LiveVmHint } from './reconcile-types.js';
import { errInfo } from './reconcile-types.js';

/**
 * Turns the OOM facts a host lists with its sandboxes into VM events: one
 * VmOomKilled per kill not yet recorded (the host's cumulative count makes
 * a repeated report a no-op). A VM whose init died of one is ended by the
 * stopped-sandbox verdict with reason `oom` (the reconciler runs this first). Runs inside the reconcile cycle, on the listing it already
 * made: no call of its own to the host.
 */
export class OomRecorder {
  constructor(
    private readonly vmHandler: BoundOf<typeof vmAggregate>,
    private readonly logger: Logger,
    private readonly clock: () => Date = () => new Date(),
  ) {}

  /** Returns how many kills were recorded. */
  async record(
    hostId: string,
    infos: readonly VmInfo[],
    hints: readonly LiveVmHint[],
    gone: Set<string>,
    actor: Actor,
  ): Promise<{ kills: number; errors: number }> {
    const out = { kills: 0, errors: 0 };
    const byName = new Map(infos.map((i) => [i.name, i]));
    for (const hint of hints) {
      const name = sandboxName(hint.id);
      const oom = byName.get(name)?.oom;
      if (hint.state !== 'running' || !oom || gone.has(name) || (oom.kills === 0 && !oom.init_oom_killed)) continue;
      try {
        const { state: vm } = await this.vmHandler.load(hint.id);
        if (vm.status !== 'running' || vm.host_id !== hostId) continue;
        let recorded = vm.oom_kills ?? 0;
        const record = async (process: string, pid: number | undefined, count: number, at: string): Promise<void> => {
          await this.vmHandler.handle(
            hint.id,
            { type: 'RecordOomKill', data: { vm_id: hint.id, process, pid, limit_mb: oom.limit_mb, count, at } },
            actor,
          );
          recorded = count;
          out.kills++;
        };
        for (const e of oom.events) {
          if (e.count <= recorded) continue;
          // Kills the host counted but could not name (its agent restarted in between): recorded as such, not dropped.
          if (e.count > recorded + 1) await record('unknown', undefined, e.count - 1, e.at);
          await record(e.process, e.pid, e.count, e.at);
        }
        if (oom.kills > recorded) await record('unknown', undefined, oom.kills, this.clock().toISOString());
        // The end itself is the stopped-sandbox verdict's (reason `oom`, from the listing's init_oom_killed), right after.
        if (oom.init_oom_killed) this.logger.warn({ vm_id: hint.id, host_id: hostId, limit_mb: oom.limit_mb }, 'vm init was OOM-killed');
      } catch (err) {
        out.errors++;
        this.logger.warn({ vm_id: hint.id, host_id: hostId, err: errInfo(err) }, 'could not record an OOM kill');
      }
    }
    return out;
  }
}
