import { copyToConsole } from './startup-console.js';
import { createHash, randomBytes } from 'node:crypto';
import { bindAggregate, type BoundOf } from '../command-handler.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { Logger } from 'pino';
import type { AttachStart, ExecResult, ExecStreamStart } from '@fleet/agent-protocol';
import {
  AppError,
  EGRESS_PROVISION_FAILED,
  egressSpecProblems,
  egressSpecSchema,
  NotFoundError,
  ValidationError,
  type EgressStatus,
} from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import { classifyHostAgentError, type AgentStream, type FileDownload, type HostAgent } from '../../domain/host-agent.port.js';
import {
  placementRequestOf,
  RESERVED_GUEST_DIR,
  sealedFieldContext,
  validateVmSpec,
  validationErrorFromZod,
  type SealedField,
  type SealedSpecFields,
  type SpecLimits,
  type StoredVmSpec,
  type VmSpec,
} from '../../domain/vm/spec.js';
import { type ExistingVmState, type VmCommand } from '../../domain/vm/vm.decider.js';
import type { DestroyReason, FailReason } from '../../domain/vm/vm.lifecycle.js';
import type { SecretBox } from '../../domain/secret-box.port.js';
import type { CommandHandler, CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import type { Placer, PlaceHints } from '../placement/place-and-reserve.js';
import type { IngressPublisher } from '../ingress/ingress-commands.js';
import { agentEgressOf, bootSandbox, sandboxName } from './boot-sandbox.js';
import { egressProvisionFailure } from './egress-failures.js';
import { assertEgressProvisionable, type EgressRegistry } from '../../domain/egress/egress-registry.js';

export { SANDBOX_PREFIX, sandboxName } from './boot-sandbox.js';
export const vmTokenContext = (vmId: string): string => `vm:${vmId}`;

/** A VM's sealed guest inputs in clear, for a later boot of its disk (fork, migrate). */
export interface GuestInputs {
  readonly agentCommand: string | undefined;
  readonly drainCommand: string | undefined;
  readonly secrets: Record<string, string>;
}

export interface VmCommandsConfig {
  readonly limits: SpecLimits;
  readonly execDefaultTimeoutMs: number;
  readonly execMaxTimeoutMs: number;
  readonly startupScriptTimeoutMs: number;
  /** Exec/attach activity is recorded at most this often per VM (idle expiry needs minutes, not every call). */
  readonly activityCoalesceMs?: number;
  /** EGRESS_PROXIES; undefined: proxy-mode VMs are refused. */
  readonly egressRegistry?: EgressRegistry | undefined;
}

export interface VmResult {
  readonly vm: ExistingVmState;
  readonly position: Position | undefined;
}

/**
 * Where a seed snapshot's artifact is and how it gets to a host (the
 * snapshot commands implement it): placement prefers holders, and the
 * winner is given a copy before boot when it has none.
 */
export interface SeedArtifacts {
  /** Hosts holding the seed for this caller; SNAPSHOT_NOT_FOUND for another tenant's or a missing one. */
  holders(snapshotId: string, actor: Actor): Promise<ReadonlySet<string>>;
  /** Moves the artifact onto `hostId` unless it already holds it; records the move. */
  ensureOn(snapshotId: string, hostId: string, actor: Actor): Promise<void>;
}

/** For flows built on create (fork, migrate): hosts to avoid. */
export interface CreateOptions {
  readonly excludeHosts?: ReadonlySet<string> | undefined;
}

/** A caller: the tenant from its key, or an admin that may touch any tenant's VM. */
export interface Actor extends CommandMeta {
  readonly tenantId: string;
  readonly admin: boolean;
}

/**
 * The VM lifecycle: create (validate → requested → place and reserve on the
 * host stream → placed → drive the agent → running | failed with the
 * capacity released), destroy, exec, files, streaming exec and attach.
 */
export class VmCommands {
  private readonly lastActivity = new Map<string, number>();
  private seeds: SeedArtifacts | undefined;
  /** Set when an ingress domain is configured: endpoints are then published at stable URLs. */
  ingress: IngressPublisher | undefined;

  private readonly vmHandler: BoundOf<typeof vmAggregate>;

  constructor(
    private readonly handler: CommandHandler,
    private readonly hosts: HostCommands,
    private readonly placer: Placer,
    private readonly secrets: SecretBox,
    private readonly config: VmCommandsConfig,
    private readonly logger: Logger,
  ) {
    this.vmHandler = bindAggregate(handler, vmAggregate);
  }

  /**
   * Creates a VM and waits for it to run. With an idempotency key the VM id
   * is derived from (tenant, key), so a retry lands on the same stream and
   * returns the same VM instead of making a second one.
   */
  setSeedArtifacts(seeds: SeedArtifacts): void {
    this.seeds = seeds;
  }

  async create(input: unknown, actor: Actor, idempotencyKey?: string, opts: CreateOptions = {}): Promise<VmResult> {
    const spec = validateVmSpec(input, this.config.limits);
    assertEgressProvisionable(spec.egress, this.config.egressRegistry);
    // Resolved before anything is written: an unknown or foreign seed is a 404, not a failed VM.
    const artifactHosts = spec.seed_snapshot_id && this.seeds ? await this.seeds.holders(spec.seed_snapshot_id, actor) : undefined;
    if (idempotencyKey !== undefined && !/^[\x21-\x7e]{1,200}$/.test(idempotencyKey)) {
      throw new ValidationError('Idempotency-Key must be 1-200 printable ASCII characters', [
        { path: 'headers.idempotency-key', message: 'invalid' },
      ]);
    }
    const vmId = idempotencyKey
      ? createHash('sha256').update(`${actor.tenantId}\0${idempotencyKey}`).digest('hex').slice(0, 24)
      : randomBytes(12).toString('hex');
    const sealed = this.sealSpec(vmId, spec);
    const requested = await this.run(
      vmId,
      { type: 'RequestVm', data: { vm_id: vmId, spec, sealed, tenant_id: actor.tenantId, idempotency_key: idempotencyKey } },
      actor,
    );
    if (requested.position === undefined) {
      // A retry (or a concurrent twin): the request that wrote VmRequested owns the work. Driving it here too would
      // boot the sandbox twice and fail the VM on SANDBOX_EXISTS; wait (bounded) for where the owner gets to.
      if (requested.vm.tenant_id !== actor.tenantId) throw new NotFoundError('VM_NOT_FOUND', `vm ${vmId} does not exist`);
      return this.settled(vmId, requested);
    }
    return this.placeAndBoot(requested.vm, spec, actor, { artifactHosts, excludeHosts: opts.excludeHosts });
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
      const { state } = await this.vmHandler.load(vmId);
      if (state.status !== 'initial') vm = state;
    }
    return { vm, position: undefined };
  }

  private async placeAndBoot(vm: ExistingVmState, spec: VmSpec, actor: Actor, where: PlaceHints = {}): Promise<VmResult> {
    const vmId = vm.vm_id;
    const started = Date.now();
    // Place: decide on the view, reserve on the host stream; a lost race re-decides.
    let hostId: string;
    try {
      const r = await this.placer.placeAndReserve(vmId, placementRequestOf(spec), spec, actor, where);
      hostId = r.hostId;
      await this.run(
        vmId,
        { type: 'PlaceVm', data: { vm_id: vmId, host_id: hostId, decision: r.choice.decision, reservation: r.reservation } },
        actor,
      );
    } catch (err) {
      await this.fail(vmId, 'error', err, actor, 'PLACEMENT_FAILED');
      throw err;
    }
    const agentFor = async (): Promise<HostAgent> => this.hosts.agentFor(hostId);
    let created = false;
    // `created` flips in the onCreated callback: read it through a call, not a narrowed local.
    const wasCreated = (): boolean => created;
    try {
      await this.run(vmId, { type: 'StartBoot', data: { vm_id: vmId } }, actor);
      if (spec.seed_snapshot_id && this.seeds) await this.seeds.ensureOn(spec.seed_snapshot_id, hostId, actor);
      const agent = await agentFor();
      // A per-VM credential, minted here so a copy of this VM (fork) never speaks as it.
      const token = randomBytes(32).toString('base64url');
      const { info, endpoints } = await bootSandbox(
        agent,
        {
          vmId,
          tenantId: vm.tenant_id,
          spec,
          image: spec.image,
          checkpointId: spec.seed_snapshot_id,
          env: spec.secrets ?? {},
          agent: spec.agent
            ? { command: spec.agent.command, drainCommand: spec.agent.drain_command ?? '', files: spec.agent.files ?? {} }
            : undefined,
        },
        { onCreated: () => (created = true), setup: (name) => this.setUpGuest(agent, name, spec, token) },
      );
      const shown = this.ingress
        ? await this.ingress.publish({ vm_id: vmId, tenant_id: vm.tenant_id, spec }, hostId, endpoints, actor)
        : undefined;
      const url = shown?.url ?? (info.ip ? `http://${info.ip}` : '');
      return await this.run(
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
        await this.run(vmId, egressFailed, actor).catch((e: unknown) =>
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
      await this.releaseCapacity(hostId, vmId, actor);
      throw err;
    }
  }

  /** A new VM's guest: the fleet's directory and token, the caller's files, then its startup script. */
  private async setUpGuest(agent: HostAgent, name: string, spec: VmSpec, token: string): Promise<void> {
    const dirs = new Set([RESERVED_GUEST_DIR, ...Object.keys(spec.files ?? {}).map((p) => p.slice(0, p.lastIndexOf('/')) || '/')]);
    const mkdir = await agent.exec(name, { argv: ['mkdir', '-p', ...dirs], timeout_ms: 10_000 });
    if (mkdir.exit_code !== 0) throw new AppError('GUEST_SETUP_FAILED', 502, `could not create guest directories: ${tail(mkdir.stderr)}`);
    await agent.upload(name, `${RESERVED_GUEST_DIR}/token`, Buffer.from(token), { mode: '0600' });
    for (const [path, content] of Object.entries(spec.files ?? {})) {
      await agent.upload(name, path, Buffer.from(content, 'base64'));
    }
    if (spec.startup_script) {
      const timeoutMs =
        spec.startup_script_timeout_s !== undefined ? spec.startup_script_timeout_s * 1000 : this.config.startupScriptTimeoutMs;
      await agent.upload(name, `${RESERVED_GUEST_DIR}/startup.sh`, Buffer.from(spec.startup_script), { mode: '0755' });
      const r = await agent.exec(
        name,
        { argv: ['/bin/sh', `${RESERVED_GUEST_DIR}/startup.sh`], timeout_ms: timeoutMs },
        { timeoutMs: timeoutMs + 10_000 },
      );
      await copyToConsole(agent, name, r, (text) => scrub(text, Object.values(spec.secrets ?? {})));
      if (r.timed_out) throw new AppError('STARTUP_SCRIPT_TIMEOUT', 504, `startup script did not finish within ${timeoutMs} ms`);
      if (r.exit_code !== 0) {
        throw new AppError('STARTUP_SCRIPT_FAILED', 422, `startup script exited with code ${r.exit_code}: ${tail(r.stderr || r.stdout)}`, {
          exit_code: r.exit_code,
        });
      }
    }
  }

  /** The reason is the caller's: `admin` for the admin key, `client` for a tenant, unless a process names its own (idle, evicted). */
  async destroy(vmId: string, actor: Actor, reason: DestroyReason = actor.admin ? 'admin' : 'client'): Promise<VmResult> {
    const current = await this.get(vmId, actor);
    if (current.status === 'destroyed' || current.status === 'failed') return { vm: current, position: undefined };
    const requested = await this.run(vmId, { type: 'RequestDestroy', data: { vm_id: vmId, reason } }, actor);
    if (requested.vm.status !== 'destroying') return requested;
    const hostId = requested.vm.host_id;
    if (hostId) {
      const agent = await this.hosts.agentFor(hostId);
      await agent.destroyVm(sandboxName(vmId));
      await this.releaseCapacity(hostId, vmId, actor);
    }
    this.lastActivity.delete(vmId);
    const done = await this.run(vmId, { type: 'ConfirmDestroyed', data: { vm_id: vmId } }, actor);
    // The route table already drops an ending VM; this records it for the readers of the stream.
    await this.ingress
      ?.unpublish(vmId, actor)
      .catch((err: unknown) =>
        this.logger.warn({ vm_id: vmId, err: { message: (err as Error).message } }, 'ingress unpublish not recorded'),
      );
    return done;
  }

  /** The VM as its stream says, for this caller: another tenant's VM does not exist (404, not 403). */
  async get(vmId: string, actor: Pick<Actor, 'tenantId' | 'admin'>): Promise<ExistingVmState> {
    if (!/^[a-z0-9-]{1,64}$/.test(vmId)) throw new NotFoundError('VM_NOT_FOUND', `vm ${vmId} does not exist`);
    const { state } = await this.vmHandler.load(vmId);
    if (state.status === 'initial' || (!actor.admin && state.tenant_id !== actor.tenantId))
      throw new NotFoundError('VM_NOT_FOUND', `vm ${vmId} does not exist`, { vm_id: vmId });
    return state;
  }

  async exec(
    vmId: string,
    req: { argv: string[]; env?: Record<string, string>; cwd?: string; timeout_ms?: number; stdin?: string },
    actor: Actor,
  ): Promise<ExecResult> {
    const { vm, agent } = await this.running(vmId, actor);
    const timeoutMs = Math.min(
      req.timeout_ms && req.timeout_ms > 0 ? req.timeout_ms : this.config.execDefaultTimeoutMs,
      this.config.execMaxTimeoutMs,
    );
    this.touch(vm, actor);
    return agent.exec(
      sandboxName(vmId),
      { argv: req.argv, env: req.env ?? {}, cwd: req.cwd, timeout_ms: timeoutMs, stdin: req.stdin },
      { timeoutMs: timeoutMs + 15_000 },
    );
  }

  async execStream(vmId: string, start: ExecStreamStart, actor: Actor): Promise<AgentStream> {
    const { vm, agent } = await this.running(vmId, actor);
    const timeoutMs = Math.min(
      start.timeout_ms && start.timeout_ms > 0 ? start.timeout_ms : this.config.execDefaultTimeoutMs,
      this.config.execMaxTimeoutMs,
    );
    this.touch(vm, actor);
    return agent.execStream(sandboxName(vmId), { ...start, timeout_ms: timeoutMs });
  }

  async attach(vmId: string, start: AttachStart, actor: Actor): Promise<AgentStream> {
    const { vm, agent } = await this.running(vmId, actor);
    this.touch(vm, actor);
    return agent.attach(sandboxName(vmId), start);
  }

  async upload(
    vmId: string,
    path: string,
    data: Uint8Array | AsyncIterable<Uint8Array>,
    actor: Actor,
  ): Promise<{ path: string; size_bytes: number }> {
    assertCallerPath(path);
    const { vm, agent } = await this.running(vmId, actor);
    this.touch(vm, actor);
    return agent.upload(sandboxName(vmId), path, data);
  }

  async download(vmId: string, path: string, actor: Actor, maxBytes?: number): Promise<FileDownload> {
    assertNormalisedPath(path);
    const { vm, agent } = await this.running(vmId, actor);
    this.touch(vm, actor);
    return agent.openDownload(sandboxName(vmId), path, { maxBytes });
  }

  /**
   * Replaces a running VM's outbound policy: validated like a create's, the
   * host applies it, then VmEgressChanged records it (a retry re-applies the
   * same policy, which the agent takes idempotently).
   */
  async changeEgress(vmId: string, input: unknown, actor: Actor): Promise<VmResult> {
    const parsed = egressSpecSchema.safeParse(input);
    if (!parsed.success) throw validationErrorFromZod(parsed.error, 'egress policy');
    const problems = egressSpecProblems(parsed.data);
    if (problems.length > 0)
      throw new ValidationError(
        `invalid egress policy: ${problems.map((p) => `${p.path}: ${p.message}`).join('; ')}`,
        problems.map((p) => ({ path: p.path, message: p.message })),
        problems.find((p) => p.code !== 'VALIDATION_FAILED')?.code ?? 'VALIDATION_FAILED',
      );
    assertEgressProvisionable(parsed.data, this.config.egressRegistry);
    const { agent } = await this.running(vmId, actor);
    await agent.setEgress(sandboxName(vmId), agentEgressOf(parsed.data)).catch(async (err: unknown) => {
      const egressFailed = egressProvisionFailure(vmId, parsed.data, err);
      if (egressFailed) await this.run(vmId, egressFailed, actor).catch(() => undefined);
      throw err;
    });
    return this.run(vmId, { type: 'ChangeEgress', data: { vm_id: vmId, egress: parsed.data } }, actor);
  }

  /**
   * The resolved policy: mode and provider from the VM's events; for a
   * running VM, the endpoint and its health as its host probes them now
   * (health `unknown` when the host does not answer). Never a fallback:
   * an unhealthy proxy is reported as such.
   */
  async egressStatus(vmId: string, actor: Actor): Promise<EgressStatus> {
    const vm = await this.get(vmId, actor);
    const e = vm.spec.egress ?? { mode: 'direct' as const };
    const base: EgressStatus = { mode: e.mode, ...(e.provider !== undefined ? { provider: e.provider } : {}) };
    if (vm.status !== 'running' || !vm.host_id) return base;
    try {
      const agent = await this.hosts.agentFor(vm.host_id);
      const live = await agent.egressStatus(sandboxName(vmId), { timeoutMs: 5000 });
      return { ...live, ...base, ...(live.mode === e.mode ? {} : { health: 'unhealthy' as const }) };
    } catch {
      return { ...base, health: 'unknown' };
    }
  }

  /**
   * The host agent and sandbox that serve a running VM's in-sandbox traffic (E2B's envd; the ingress too).
   * Looked up for any tenant: the caller has already checked the VM's own access token. Counts as activity.
   */
  async sandboxFor(vmId: string, meta: CommandMeta): Promise<{ agent: HostAgent; name: string; tenantId: string }> {
    const { vm, agent } = await this.running(vmId, { ...meta, tenantId: 'admin', admin: true });
    this.touch(vm, { ...meta, tenantId: vm.tenant_id, admin: false });
    return { agent, name: sandboxName(vmId), tenantId: vm.tenant_id };
  }

  private async running(vmId: string, actor: Actor): Promise<{ vm: ExistingVmState; agent: HostAgent }> {
    const vm = await this.get(vmId, actor);
    if (vm.status !== 'running' || !vm.host_id) {
      throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: exec, attach and files need a running VM`, {
        vm_id: vmId,
        status: vm.status,
      });
    }
    return { vm, agent: await this.hosts.agentFor(vm.host_id) };
  }

  /**
   * Activity for idle expiry from outside a request of this class: an open
   * exec or attach session while it lasts, an ingress request or connection.
   * Coalesced like the rest; a VM that is not running is left alone.
   */
  async recordActivity(vmId: string, actor: Actor): Promise<void> {
    const vm = await this.get(vmId, actor);
    if (vm.status === 'running') this.touch(vm, actor);
  }

  /**
   * An open exec or attach session is activity for as long as it lasts, not
   * only when it starts: recorded every ACTIVITY_COALESCE_MS until the
   * returned function is called.
   */
  keepActive(vmId: string, actor: Actor): () => void {
    const timer = setInterval(
      () =>
        void this.recordActivity(vmId, actor).catch((err: unknown) =>
          this.logger.debug({ vm_id: vmId, err: { message: (err as Error).message } }, 'session activity not recorded'),
        ),
      Math.max(this.config.activityCoalesceMs ?? 60_000, 100),
    );
    timer.unref();
    return () => clearInterval(timer);
  }

  /** Idle expiry reads control-plane activity; coalesced so a busy VM does not write an event per exec. */
  private touch(vm: ExistingVmState, actor: Actor): void {
    const now = Date.now();
    const last = this.lastActivity.get(vm.vm_id) ?? Date.parse(vm.last_activity_at);
    if (now - last < (this.config.activityCoalesceMs ?? 60_000)) return;
    this.lastActivity.set(vm.vm_id, now);
    this.run(vm.vm_id, { type: 'RecordActivity', data: { vm_id: vm.vm_id } }, actor).catch((err: unknown) =>
      this.logger.debug({ vm_id: vm.vm_id, err: { message: (err as Error).message } }, 'activity not recorded'),
    );
  }

  /** `fallbackCode` when the error carries none of its own: an `error` end always says what went wrong. */
  private async fail(vmId: string, reason: FailReason, err: unknown, actor: Actor, fallbackCode: string): Promise<void> {
    const e = err instanceof AppError ? err : undefined;
    await this.run(
      vmId,
      {
        type: 'FailVm',
        data: { vm_id: vmId, reason, error: (err as { message?: string }).message ?? String(err), error_code: e?.code ?? fallbackCode },
      },
      actor,
    ).catch((failErr: unknown) => this.logger.error({ vm_id: vmId, err: failErr }, 'could not record a VM failure; the reconciler will'));
  }

  async releaseCapacity(hostId: string, vmId: string, meta: CommandMeta): Promise<void> {
    await this.placer.release(hostId, vmId, meta);
  }

  private async run(vmId: string, command: VmCommand, meta: CommandMeta): Promise<VmResult> {
    const r = await this.vmHandler.handle(vmId, command, meta);
    if (r.state.status === 'initial') throw new AppError('INTERNAL', 500, `vm ${vmId} has no state after ${command.type}`);
    return { vm: r.state, position: r.position };
  }
}

/** Every occurrence of a secret value replaced, longest first so a value containing another is not half-shown. */
export function scrub(text: string, values: readonly string[]): string {
  let out = text;
  for (const v of [...values].filter((x) => x.length > 0).sort((a, b) => b.length - a.length)) out = out.split(v).join('[sealed]');
  return out;
}

function tail(s: string, n = 500): string {
  return s.length > n ? `…${s.slice(-n)}` : s;
}

/** Client paths for uploads: absolute, normalised, never under the fleet's reserved directory. */
function assertNormalisedPath(path: string): void {
  const segments = path.slice(1).split('/');
  if (!path.startsWith('/') || path.includes('\0') || segments.some((s) => s === '' || s === '.' || s === '..')) {
    throw new ValidationError(
      `path ${JSON.stringify(path)} must be absolute and normalised (no "..", ".", or empty segments)`,
      [{ path: 'querystring.path', message: 'not an absolute normalised path' }],
      'INVALID_GUEST_PATH',
    );
  }
}

function assertCallerPath(path: string): void {
  assertNormalisedPath(path);
  if (path === RESERVED_GUEST_DIR || path.startsWith(`${RESERVED_GUEST_DIR}/`)) {
    throw new ValidationError(
      `${path} is under ${RESERVED_GUEST_DIR}, reserved for the fleet's own files`,
      [{ path: 'querystring.path', message: 'reserved' }],
      'RESERVED_GUEST_PATH',
    );
  }
}
