import type { Logger } from 'pino';
import { AppError } from '@fleet/agent-protocol';
import type { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { VmCommand } from '../../domain/vm/vm.decider.js';
import type { Endpoint } from '../../domain/vm/vm.events.js';
import type { BoundOf } from '../command-handler.js';
import type { HostAgent } from '../../domain/host-agent.port.js';
import type { Reserved } from '../placement/place-and-reserve.js';
import type { Actor, VmCommands } from '../vm/vm-commands.js';

/**
 * The switch step of a migration, cold or live: the VM's stream records it
 * running on the target (with the URLs the ingress shows, so they do not
 * change), then the ingress routes are pointed at the target. A route left
 * on the source is logged, not thrown: the VM already runs on the target.
 */
export async function switchToTarget(
  deps: { readonly vmHandler: BoundOf<typeof vmAggregate>; readonly vms: VmCommands; readonly logger: Logger },
  m: {
    readonly vmId: string;
    readonly fromHostId: string;
    readonly placed: Reserved;
    readonly snapshotId: string;
    readonly ip: string | undefined;
    readonly endpoints: Endpoint[];
  },
  actor: Actor,
) {
  const { vmId, fromHostId, placed, endpoints } = m;
  const shown = deps.vms.ingress ? await deps.vms.ingress.present(vmId, endpoints) : undefined;
  const switched = await deps.vmHandler.handle(
    vmId,
    {
      type: 'CompleteMigration',
      data: {
        vm_id: vmId,
        from_host_id: fromHostId,
        host_id: placed.hostId,
        decision: placed.choice.decision,
        reservation: placed.reservation,
        snapshot_id: m.snapshotId,
        url: shown?.url ?? (m.ip ? `http://${m.ip}` : ''),
        endpoints: shown?.endpoints ?? endpoints,
      },
    } satisfies VmCommand,
    actor,
  );
  if (switched.state.status === 'initial') throw new AppError('INTERNAL', 500, `vm ${vmId} vanished`);
  await deps.vms.ingress
    ?.adopt(vmId, placed.hostId, endpoints, actor)
    .catch((err: unknown) =>
      deps.logger.error(
        { vm_id: vmId, err: { message: (err as Error).message } },
        'migrated, but its ingress routes still name the source',
      ),
    );
  return switched;
}

/**
 * The step after the switch, for every kind of move: the source's sandbox is destroyed, its reservation released and
 * the `destroy_source` step recorded. The VM already runs on the target, so a failure is logged, not thrown: what it
 * leaves on the source the reconciler collects.
 */
export async function destroySource(
  deps: { readonly vms: VmCommands; readonly logger: Logger },
  m: { readonly vmId: string; readonly name: string; readonly fromHostId: string; readonly source: () => Promise<HostAgent> | HostAgent },
  recordStep: () => Promise<unknown>,
  actor: Actor,
  left: string,
): Promise<void> {
  try {
    const src = await m.source();
    await src.destroyVm(m.name, { force: true });
    await deps.vms.releaseCapacity(m.fromHostId, m.vmId, actor);
    await recordStep();
  } catch (err) {
    deps.logger.warn({ vm_id: m.vmId, host_id: m.fromHostId, err: { message: (err as Error).message } }, `${left}; the reconciler will`);
  }
}
