import type { Logger } from 'pino';
import type { AttachStart, ExecResult, ExecStreamStart } from '@fleet/agent-protocol';
import { AppError, ValidationError } from '@fleet/agent-protocol';
import type { AgentStream, FileDownload, HostAgent } from '../../domain/host-agent.port.js';
import { RESERVED_GUEST_DIR } from '../../domain/vm/spec.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import type { CommandMeta } from '../command-handler.js';
import type { HostCommands } from '../host/host-commands.js';
import { sandboxName } from './boot-sandbox.js';
import type { VmStream } from './vm-stream.js';
import type { Actor, VmCommandsConfig } from './vm-types.js';

/**
 * Inside a running VM: exec (buffered and streaming), attach, file upload and
 * download, the sandbox behind in-sandbox traffic; and the activity each of
 * them records for idle expiry (coalesced per VM).
 */
export class VmAccess {
  private readonly lastActivity = new Map<string, number>();

  constructor(
    private readonly stream: VmStream,
    private readonly hosts: HostCommands,
    private readonly config: VmCommandsConfig,
    private readonly logger: Logger,
  ) {}

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
   * The host agent and sandbox that serve a running VM's in-sandbox traffic (E2B's envd; the ingress too).
   * Looked up for any tenant: the caller has already checked the VM's own access token. Counts as activity.
   */
  async sandboxFor(vmId: string, meta: CommandMeta): Promise<{ agent: HostAgent; name: string; tenantId: string }> {
    const { vm, agent } = await this.running(vmId, { ...meta, tenantId: 'admin', admin: true });
    this.touch(vm, { ...meta, tenantId: vm.tenant_id, admin: false });
    return { agent, name: sandboxName(vmId), tenantId: vm.tenant_id };
  }

  async running(vmId: string, actor: Actor): Promise<{ vm: ExistingVmState; agent: HostAgent }> {
    const vm = await this.stream.get(vmId, actor);
    if (vm.status !== 'running' || !vm.host_id) {
      throw new AppError('VM_NOT_RUNNING', 409, `vm ${vmId} is ${vm.status}: exec, attach and files need a running VM`, {
        vm_id: vmId,
        status: vm.status,
      });
    }
    return { vm, agent: await this.hosts.agentFor(vm.host_id) };
  }

  /** A destroyed VM's coalescing entry goes with it. */
  forget(vmId: string): void {
    this.lastActivity.delete(vmId);
  }

  /**
   * Activity for idle expiry from outside a request of this class: an open
   * exec or attach session while it lasts, an ingress request or connection.
   * Coalesced like the rest; a VM that is not running is left alone.
   */
  async recordActivity(vmId: string, actor: Actor): Promise<void> {
    const vm = await this.stream.get(vmId, actor);
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
  touch(vm: ExistingVmState, actor: Actor): void {
    const now = Date.now();
    const last = this.lastActivity.get(vm.vm_id) ?? Date.parse(vm.last_activity_at);
    if (now - last < (this.config.activityCoalesceMs ?? 60_000)) return;
    this.lastActivity.set(vm.vm_id, now);
    this.stream
      .run(vm.vm_id, { type: 'RecordActivity', data: { vm_id: vm.vm_id } }, actor)
      .catch((err: unknown) => this.logger.debug({ vm_id: vm.vm_id, err: { message: (err as Error).message } }, 'activity not recorded'));
  }
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
