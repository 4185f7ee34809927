import { createHash, randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { AppError, EGRESS_PROVISION_FAILED, NotFoundError, ValidationError } from '@fleet/agent-protocol';
import { assertEgressProvisionable } from '../../domain/egress/egress-registry.js';
import { classifyHostAgentError, type HostAgent } from '../../domain/host-agent.port.js';
import type { SecretBox } from '../../domain/secret-box.port.js';
import {
  checkVmSpec,
  placementRequestOf,
  sealedFieldContext,
  type SealedField,
  type SealedSpecFields,
  type StoredVmSpec,
  type VmSpec,
} from '../../domain/vm/spec.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { FailReason } from '../../domain/vm/vm.lifecycle.js';
import type { HostCommands } from '../host/host-commands.js';
import type { IngressPublisher } from '../ingress/ingress-commands.js';
import type { NetworkCommands, NetworkJoinPlan } from '../network/network-commands.js';
import type { Placer, PlaceHints } from '../placement/place-and-reserve.js';
import { bootSandbox, sandboxName } from './boot-sandbox.js';
import { egressProvisionFailure } from './egress-failures.js';
import { guestFiles, scrub, setUpGuest } from './guest-setup.js';
import type { VmStream } from './vm-stream.js';
import {
  vmTokenContext,
  type Actor,
  type CreateOptions,
  type GuestInputs,
  type SeedArtifacts,
  type VmCommandsConfig,
  type VmResult,
} from './vm-types.js';

/**
 * Create: validate → requested → place and reserve on the host stream →
 * placed → drive the agent → running | failed with the capacity released;
 * and the sealing of the spec's guest inputs (and their opening for a later boot).
 */
export class VmCreate {
  /** Wired after construction (service.ts), like `ingress`: where seed snapshots' artifacts are. */
  seeds: SeedArtifacts | undefined;
  /** Set when an ingress domain is configured: endpoints are then published at stable URLs. */
  ingress: IngressPublisher | undefined;
  /** Wired after construction (service.ts): tenant networks a VM may join (`network_id`). */
  networks: NetworkCommands | undefined;

  constructor(
    private readonly stream: VmStream,
    private readonly hosts: HostCommands,
    private readonly placer: Placer,
    private readonly secrets: SecretBox,
    private readonly config: VmCommandsConfig,
    private readonly logger: Logger,
  ) {}

  async create(spec: VmSpec, actor: Actor, idempotencyKey?: string, opts: CreateOptions = {}): Promise<VmResult> {
    checkVmSpec(spec, this.config.limits);
    assertEgressProvisionable(spec.egress, this.config.egressRegistry);
    // Resolved before anything is written: an unknown or foreign seed is a 404, not a failed VM.
    const artifactHosts = spec.seed_snapshot_id && this.seeds ? await this.seeds.holders(spec.seed_snapshot_id, actor) : undefined;
    // Likewise: another tenant's network is a 404, a hint outside its subnet a 400, before anything is written.
    const network = spec.network_id ? await this.networkPlan(spec.network_id, spec.ip_hint, actor) : undefined;
    if (idempotencyKey !== undefined && !/^[\x21-\x7e]{1,200}$/.test(idempotencyKey)) {
      throw new ValidationError('Idempotency-Key must be 1-200 printable ASCII characters', [
        { path: 'headers.idempotency-key', message: 'invalid' },
      ]);
    }
    const vmId = idempotencyKey
      ? createHash('sha256').update(`${actor.tenantId}\0${idempotencyKey}`).digest('hex').slice(0, 24)
      : randomBytes(12).toString('hex');
    const sealed = this.sealSpec(vmId, spec);
    const requested = await this.stream.run(
      vmId,
      { type: 'RequestVm', data: { vm_id: vmId, spec, sealed, tenant_id: actor.tenantId, idempotency_key: idempotencyKey } },
      actor,
      // A random id names a stream nobody has written: no read before the append. A keyed id may be a retry's.
      { newStream: idempotencyKey === undefined },
    );
    if (requested.position === undefined) {
      // A retry (or a concurrent twin): the request that wrote VmRequested owns the work. Driving it here too would
      // boot the sandbox twice and fail the VM on SANDBOX_EXISTS; wait (bounded) for where the owner gets to.
      if (requested.vm.tenant_id !== actor.tenantId) throw new NotFoundError('VM_NOT_FOUND', `vm ${vmId} does not exist`);
      return this.settled(vmId, requested);
    }
    // An idle VM that is to be paused must sit where memory can be checkpointed.
    let excludeHosts = opts.excludeHosts;
    if (spec.on_idle === 'pause') {
      const unfit = new Set(excludeHosts);
      for (const h of await this.placer.hosts()) if (h.capacity.live_snapshot !== true) unfit.add(h.id);
      excludeHosts = unfit;
    }
    return this.placeAndBoot(requested.vm, spec, actor, { artifactHosts, excludeHosts }, network, opts.resume === true);
  }

  private sealSpec(vmId: string, spec: VmSpec): SealedSpecFields {
    const secrets = spec.secrets && Object.keys(spec.secrets).length > 0 ? spec.secrets : undefined;
    return {
      startup_script:
        spec.startup_script !== undefined ? this.secrets.seal(spec.startup_script, sealedFieldContext(vmId, 'startup_script')) : undefined,
      agent_command: spec.agent ? this.secrets.seal(spec.agent.command, sealedFieldContext(vmId, 'agent.command')) : undefined,
      agent_drain_command: spec.agent?.drain_command
        ? this.secrets.seal(spec.agent.drain_command, sealedFieldContext(vmId, 'agent.drain_command'))
        : undefined,
      secrets: secrets ? this.secrets.seal(JSON.stringify(secrets), sealedFieldContext(vmId, 'secrets')) : undefined,
    };
  }

  /**
   * What a later boot of this VM's disk needs in clear (fork, cold migration):
   * the in-guest agent's command and the secrets, opened from its events.
   * Events from before sealing carry the command in clear.
   */
  openGuestInputs(vm: { vm_id: string; spec: StoredVmSpec }): GuestInputs {
    const open = (sealed: string, field: SealedField): string => {
      try {
        return this.secrets.open(sealed, sealedFieldContext(vm.vm_id, field));
      } catch {
        throw new AppError(
          'VM_SECRETS_UNREADABLE',
          500,
          `vm ${vm.vm_id}: its sealed ${field} does not decrypt with the configured TOKEN_ENCRYPTION_KEY`,
        );
      }
    };
    const agent = vm.spec.agent;
    const agentCommand = agent?.command_encrypted !== undefined ? open(agent.command_encrypted, 'agent.command') : agent?.command;
    const drainCommand =
      agent?.drain_command_encrypted !== undefined ? open(agent.drain_command_encrypted, 'agent.drain_command') : agent?.drain_command;
    const secrets =
      vm.spec.secrets_encrypted !== undefined ? (JSON.parse(open(vm.spec.secrets_encrypted, 'secrets')) as Record<string, string>) : {};
    return { agentCommand, drainCommand, secrets };
  }

  private async settled(vmId: string, first: VmResult): Promise<VmResult> {
    const deadline = Date.now() + this.config.startupScriptTimeoutMs + 60_000;
    let vm = first.vm;
    while ((vm.status === 'requested' || vm.status === 'placed' || vm.status === 'booting') && Date.now() < deadline) {
      await new Promise((resolve) => setTimeout(resolve, 100));
      const { state } = await this.stream.vmHandler.load(vmId);
      if (state.status !== 'initial') vm = state;
    }
    return { vm, position: undefined };
  }

  private async networkPlan(networkId: string, ipHint: string | undefined, actor: Actor): Promise<NetworkJoinPlan> {
    if (!this.networks) throw new AppError('NETWORKS_UNAVAILABLE', 503, 'this control plane has no network commands wired');
    return this.networks.planJoin(networkId, actor.tenantId, ipHint);
  }

  private async placeAndBoot(
    vm: ExistingVmState,
    spec: VmSpec,
    actor: Actor,
    where: PlaceHints = {},
    network?: NetworkJoinPlan,
    resume = false,
  ): Promise<VmResult> {
    const vmId = vm.vm_id;
    const started = Date.now();
    // Place: decide on the view, reserve on the host stream; a lost race re-decides.
    let hostId: string;
    let placed: Awaited<ReturnType<Placer['placeAndReserve']>>;
    try {
      const request = network ? { ...placementRequestOf(spec), network_host_id: network.host } : placementRequestOf(spec);
      // Process and qemu agents build a network's bridge; a firecracker host cannot hold a member.
      const hints = network
        ? {
            ...where,
            excludeHosts: new Set([
              ...(where.excludeHosts ?? []),
              ...(await this.placer.hosts()).filter((h) => h.backend === 'firecracker').map((h) => h.id),
            ]),
          }
        : where;
      placed = await this.placer.placeAndReserve(vmId, request, spec, actor, hints);
      hostId = placed.hostId;
    } catch (err) {
      await this.fail(vmId, 'error', err, actor, 'PLACEMENT_FAILED');
      throw err;
    }
    const agentFor = async (): Promise<HostAgent> => this.hosts.agentFor(hostId);
    let created = false;
    // `created` flips in the onCreated callback: read it through a call, not a narrowed local.
    const wasCreated = (): boolean => created;
    try {
      // Placed and booting in one append: with VmRequested and the reservation, two durable appends before the agent.
      await this.stream.run(
        vmId,
        [
          { type: 'PlaceVm', data: { vm_id: vmId, host_id: hostId, decision: placed.choice.decision, reservation: placed.reservation } },
          { type: 'StartBoot', data: { vm_id: vmId } },
        ],
        actor,
      );
      const member =
        network && this.networks
          ? { id: network.networkId, subnet: network.subnet, ip: await this.networks.join(network, vmId, hostId, spec.ip_hint, actor) }
          : undefined;
      if (spec.seed_snapshot_id && this.seeds) await this.seeds.ensureOn(spec.seed_snapshot_id, hostId, actor);
      // The host as the reservation left it: its address and token, without reading its stream again.
      const agent = this.hosts.agentForState(placed.host);
      // A per-VM credential, minted here so a copy of this VM (fork) never speaks as it.
      const token = randomBytes(32).toString('base64url');
      // The token and the caller's files ride on the create call; an agent that predates that answers
      // without `files_written`, and the files are then uploaded as before.
      const files = guestFiles(spec, token);
      let filesWritten = false;
      const { info, endpoints } = await bootSandbox(
        agent,
        {
          vmId,
          tenantId: vm.tenant_id,
          spec,
          image: spec.image,
          checkpointId: spec.seed_snapshot_id,
          resume,
          env: spec.secrets ?? {},
          network: member,
          // A resumed copy already runs the in-guest agent it captured: only its ports and drain command are registered.
          agent: spec.agent
            ? {
                command: resume ? 'true' : spec.agent.command,
                drainCommand: spec.agent.drain_command ?? '',
                files: resume ? {} : (spec.agent.files ?? {}),
              }
            : undefined,
          files,
          reservation: placed.reservation,
        },
        {
          onCreated: (made) => {
            created = true;
            filesWritten = made.files_written === files.length;
          },
          setup: (name) => setUpGuest(agent, name, spec, token, this.config.startupScriptTimeoutMs, { filesWritten }),
        },
      );
      const shown = this.ingress
        ? await this.ingress.publish({ vm_id: vmId, tenant_id: vm.tenant_id, spec }, hostId, endpoints, actor)
        : undefined;
      const url = shown?.url ?? (info.ip ? `http://${info.ip}` : '');
      return await this.stream.run(
        vmId,
        {
          type: 'CompleteBoot',
          data: {
            vm_id: vmId,
            url,
            endpoints: shown?.endpoints ?? endpoints,
            boot_ms: Date.now() - started,
            auth_token_encrypted: this.secrets.seal(token, vmTokenContext(vmId)),
          },
        },
        actor,
      );
    } catch (err) {
      // A failing startup script may print what it was given: its output ends up in the error, the event and the log.
      if (err instanceof Error && spec.secrets) err.message = scrub(err.message, Object.values(spec.secrets));
      const cls = classifyHostAgentError(err);
      this.logger.warn(
        { vm_id: vmId, host_id: hostId, code: (err as AppError).code, class: cls, err: { message: (err as Error).message } },
        'boot failed',
      );
      // An egress provider that could not provision is a fact of its own (fleet_egress_failures_total), and the VM's end code.
      const egressFailed = egressProvisionFailure(vmId, spec.egress, err);
      if (egressFailed)
        await this.stream
          .run(vmId, egressFailed, actor)
          .catch((e: unknown) =>
            this.logger.warn({ vm_id: vmId, err: { message: (e as Error).message } }, 'could not record an egress failure'),
          );
      await this.fail(
        vmId,
        'error',
        egressFailed ? new AppError(EGRESS_PROVISION_FAILED, 502, (err as Error).message) : err,
        actor,
        'BOOT_FAILED',
      );
      // Best effort: the reconciler destroys what this could not (orphans), so a dead host does not hold the request.
      if (wasCreated() || cls !== 'capacity') {
        await agentFor()
          .then((a) => a.destroyVm(sandboxName(vmId), { force: true, timeoutMs: 10_000 }))
          .catch((e: unknown) =>
            this.logger.warn(
              { vm_id: vmId, err: { message: (e as Error).message } },
              'could not destroy the sandbox of a failed boot; the reconciler will',
            ),
          );
      }
      await this.placer.release(hostId, vmId, actor);
      throw err;
    }
  }

  /** `fallbackCode` when the error carries none of its own: an `error` end always says what went wrong. */
  private async fail(vmId: string, reason: FailReason, err: unknown, actor: Actor, fallbackCode: string): Promise<void> {
    const e = err instanceof AppError ? err : undefined;
    await this.stream
      .run(
        vmId,
        {
          type: 'FailVm',
          data: { vm_id: vmId, reason, error: (err as { message?: string }).message ?? String(err), error_code: e?.code ?? fallbackCode },
        },
        actor,
      )
      .catch((failErr: unknown) => this.logger.error({ vm_id: vmId, err: failErr }, 'could not record a VM failure; the reconciler will'));
  }
}
