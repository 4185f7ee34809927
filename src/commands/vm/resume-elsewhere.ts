import type { Logger } from 'pino';
import { ConflictError, NotFoundError } from '@fleet/agent-protocol';
import type { Endpoint } from '../../domain/vm/vm.events.js';
import { placementRequestOf } from '../../domain/vm/spec.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Placer, Reserved } from '../placement/place-and-reserve.js';
import { bootSandbox, sandboxName } from './boot-sandbox.js';
import type { Actor, VmCommands } from './vm-commands.js';

export interface ResumedElsewhere {
  readonly placed: Reserved;
  readonly endpoints: Endpoint[];
  /** Undoes what is left on the origin (the paused sandbox, the copies of the checkpoint) once the resume is recorded. */
  readonly cleanup: () => Promise<void>;
}

/**
 * A paused VM whose host has no room any more: another host that can
 * restore memory is reserved, the pause checkpoint is pulled there under a
 * grant (sha256-verified) and restored as the same VM (its address when free
 * there). Nothing on the origin changes until the caller has recorded the
 * resume; a failure leaves the VM paused on its origin.
 */
export async function resumeElsewhere(
  deps: { hosts: HostCommands; placer: Placer; vms: VmCommands; logger: Logger },
  vm: Extract<ExistingVmState, { status: 'paused' }>,
  actor: Actor,
): Promise<ResumedElsewhere> {
  const { hosts, placer, vms, logger } = deps;
  const vmId = vm.vm_id;
  const originId = vm.host_id;
  const { state: origin } = await hosts.load(originId);
  if (origin.status === 'unregistered') throw new NotFoundError('HOST_NOT_FOUND', `host ${originId} is not registered`);
  const unfit = new Set([originId]);
  for (const h of await placer.hosts()) if (h.capacity.live_snapshot !== true || h.backend !== origin.backend) unfit.add(h.id);
  const placed = await placer.placeAndReserve(
    vmId,
    { ...placementRequestOf(vm.spec), host_id: undefined, pinned_host_id: undefined },
    vm.spec,
    actor,
    { excludeHosts: unfit },
  );
  const name = sandboxName(vmId);
  const src = hosts.agentForState(origin);
  const dst = await hosts.agentFor(placed.hostId);
  const cpId = vm.checkpoint_id;
  let pulled = false;
  let booted = false;
  // `booted` flips in the onCreated callback: read it through a call, not a narrowed local.
  const isBooted = (): boolean => booted;
  try {
    const cp = (await src.listCheckpoints()).find((c) => c.id === cpId);
    if (!cp?.digest)
      throw new ConflictError('CHECKPOINT_NOT_FOUND', `the pause checkpoint ${cpId} of vm ${vmId} is not on host ${originId}`, {
        vm_id: vmId,
        host_id: originId,
      });
    const grant = await src.grantArtifact(cpId, 600);
    await dst.pullArtifact({
      snapshot_id: cpId,
      digest: cp.digest,
      from: { url: origin.url, grant: grant.grant, host_id: originId },
      files: { ...cp.files },
    });
    pulled = true;
    const ip = (await src.getVm(name)).ip;
    const guest = vms.openGuestInputs(vm);
    const { endpoints } = await bootSandbox(
      dst,
      {
        vmId,
        tenantId: vm.tenant_id,
        spec: vm.spec,
        checkpointId: cpId,
        resume: true,
        ipHint: ip,
        env: guest.secrets,
        agent: vm.spec.agent ? { command: 'true', drainCommand: guest.drainCommand ?? '', files: {} } : undefined,
        reservation: placed.reservation,
      },
      { onCreated: () => (booted = true) },
    );
    logger.info({ vm_id: vmId, from: originId, to: placed.hostId }, 'origin full: resumed on another host');
    return {
      placed,
      endpoints,
      cleanup: async () => {
        await src
          .destroyVm(name, { force: true })
          .catch((err: unknown) =>
            logger.warn({ vm_id: vmId, err: { message: (err as Error).message } }, 'the paused sandbox on the origin was not destroyed'),
          );
        await dst.deleteCheckpoint(cpId).catch(() => undefined);
      },
    };
  } catch (err) {
    if (isBooted()) await dst.destroyVm(name, { force: true }).catch(() => undefined);
    if (pulled) await dst.deleteCheckpoint(cpId).catch(() => undefined);
    await placer.release(placed.hostId, vmId, actor).catch(() => undefined);
    throw err;
  }
}
