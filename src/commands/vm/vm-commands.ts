import type { Logger } from 'pino';
import type { AttachStart, EgressStatus, ExecResult, ExecStreamStart } from '@fleet/agent-protocol';
import type { AgentStream, FileDownload, HostAgent } from '../../domain/host-agent.port.js';
import type { SecretBox } from '../../domain/secret-box.port.js';
import type { StoredVmSpec } from '../../domain/vm/spec.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { DestroyReason } from '../../domain/vm/vm.lifecycle.js';
import type { CommandHandler, CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { IngressPublisher } from '../ingress/ingress-commands.js';
import type { Placer } from '../placement/place-and-reserve.js';
import { sandboxName } from './boot-sandbox.js';
import { VmAccess } from './vm-access.js';
import { VmCreate } from './vm-create.js';
import { VmEgress } from './vm-egress.js';
import { VmStream } from './vm-stream.js';
import type { Actor, CreateOptions, GuestInputs, SeedArtifacts, VmCommandsConfig, VmResult } from './vm-types.js';

export { SANDBOX_PREFIX, sandboxName } from './boot-sandbox.js';
export { scrub } from './guest-setup.js';
export {
  vmTokenContext,
  type Actor,
  type CreateOptions,
  type GuestInputs,
  type SeedArtifacts,
  type VmCommandsConfig,
  type VmResult,
} from './vm-types.js';

/**
 * The VM lifecycle: create (vm-create.ts), destroy, and what a running VM
 * offers (exec, files, streaming exec and attach: vm-access.ts; its egress
 * policy: vm-egress.ts).
 */
export class VmCommands {
  private readonly stream: VmStream;
  private readonly creator: VmCreate;
  private readonly access: VmAccess;
  private readonly egress: VmEgress;

  constructor(
    handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly placer: Placer,
    secrets: SecretBox,
    config: VmCommandsConfig,
    private readonly logger: Logger,
  ) {
    this.stream = new VmStream(handler);
    this.creator = new VmCreate(this.stream, hosts, placer, secrets, config, logger);
    this.access = new VmAccess(this.stream, hosts, config, logger);
    this.egress = new VmEgress(this.stream, this.access, hosts, config);
  }

  /** Set when an ingress domain is configured: endpoints are then published at stable URLs. */
  get ingress(): IngressPublisher | undefined {
    return this.creator.ingress;
  }

  set ingress(publisher: IngressPublisher | undefined) {
    this.creator.ingress = publisher;
  }

  setSeedArtifacts(seeds: SeedArtifacts): void {
    this.creator.seeds = seeds;
  }

  /**
   * Creates a VM and waits for it to run. With an idempotency key the VM id
   * is derived from (tenant, key), so a retry lands on the same stream and
   * returns the same VM instead of making a second one.
   */
  create(input: unknown, actor: Actor, idempotencyKey?: string, opts: CreateOptions = {}): Promise<VmResult> {
    return this.creator.create(input, actor, idempotencyKey, opts);
  }

  /**
   * What a later boot of this VM's disk needs in clear (fork, cold migration):
   * the in-guest agent's command and the secrets, opened from its events.
   * Events from before sealing carry the command in clear.
   */
  openGuestInputs(vm: { vm_id: string; spec: StoredVmSpec }): GuestInputs {
    return this.creator.openGuestInputs(vm);
  }

  /** The reason is the caller's: `admin` for the admin key, `client` for a tenant, unless a process names its own (idle, evicted). */
  async destroy(vmId: string, actor: Actor, reason: DestroyReason = actor.admin ? 'admin' : 'client'): Promise<VmResult> {
    const current = await this.stream.get(vmId, actor);
    if (current.status === 'destroyed' || current.status === 'failed') return { vm: current, position: undefined };
    const requested = await this.stream.run(vmId, { type: 'RequestDestroy', data: { vm_id: vmId, reason } }, actor);
    if (requested.vm.status !== 'destroying') return requested;
    const hostId = requested.vm.host_id;
    if (hostId) {
      const agent = await this.hosts.agentFor(hostId);
      await agent.destroyVm(sandboxName(vmId));
      await this.releaseCapacity(hostId, vmId, actor);
    }
    this.access.forget(vmId);
    const done = await this.stream.run(vmId, { type: 'ConfirmDestroyed', data: { vm_id: vmId } }, actor);
    // The route table already drops an ending VM; this records it for the readers of the stream.
    await this.ingress
      ?.unpublish(vmId, actor)
      .catch((err: unknown) =>
        this.logger.warn({ vm_id: vmId, err: { message: (err as Error).message } }, 'ingress unpublish not recorded'),
      );
    return done;
  }

  /** The VM as its stream says, for this caller: another tenant's VM does not exist (404, not 403). */
  get(vmId: string, actor: Pick<Actor, 'tenantId' | 'admin'>): Promise<ExistingVmState> {
    return this.stream.get(vmId, actor);
  }

  exec(
    vmId: string,
    req: { argv: string[]; env?: Record<string, string>; cwd?: string; timeout_ms?: number; stdin?: string },
    actor: Actor,
  ): Promise<ExecResult> {
    return this.access.exec(vmId, req, actor);
  }

  execStream(vmId: string, start: ExecStreamStart, actor: Actor): Promise<AgentStream> {
    return this.access.execStream(vmId, start, actor);
  }

  attach(vmId: string, start: AttachStart, actor: Actor): Promise<AgentStream> {
    return this.access.attach(vmId, start, actor);
  }

  upload(
    vmId: string,
    path: string,
    data: Uint8Array | AsyncIterable<Uint8Array>,
    actor: Actor,
  ): Promise<{ path: string; size_bytes: number }> {
    return this.access.upload(vmId, path, data, actor);
  }

  download(vmId: string, path: string, actor: Actor, maxBytes?: number): Promise<FileDownload> {
    return this.access.download(vmId, path, actor, maxBytes);
  }

  /** Replaces a running VM's outbound policy (vm-egress.ts). */
  changeEgress(vmId: string, input: unknown, actor: Actor): Promise<VmResult> {
    return this.egress.changeEgress(vmId, input, actor);
  }

  /** The resolved policy, with the host's probe for a running VM (vm-egress.ts). */
  egressStatus(vmId: string, actor: Actor): Promise<EgressStatus> {
    return this.egress.egressStatus(vmId, actor);
  }

  /**
   * The host agent and sandbox that serve a running VM's in-sandbox traffic (E2B's envd; the ingress too).
   * Looked up for any tenant: the caller has already checked the VM's own access token. Counts as activity.
   */
  sandboxFor(vmId: string, meta: CommandMeta): Promise<{ agent: HostAgent; name: string; tenantId: string }> {
    return this.access.sandboxFor(vmId, meta);
  }

  /** Activity for idle expiry from outside a request of this class (vm-access.ts). */
  recordActivity(vmId: string, actor: Actor): Promise<void> {
    return this.access.recordActivity(vmId, actor);
  }

  /** Records activity every ACTIVITY_COALESCE_MS while an exec or attach session lasts, until the returned function is called. */
  keepActive(vmId: string, actor: Actor): () => void {
    return this.access.keepActive(vmId, actor);
  }

  async releaseCapacity(hostId: string, vmId: string, meta: CommandMeta): Promise<void> {
    await this.placer.release(hostId, vmId, meta);
  }
}
