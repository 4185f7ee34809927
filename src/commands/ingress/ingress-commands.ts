import { createHash, randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import { AppError, NotFoundError } from '@fleet/agent-protocol';
import { ingressAggregate, type IngressCommand, type IngressState } from '../../domain/vm/ingress.decider.js';
import type { IngressRoute } from '../../domain/vm/ingress.events.js';
import type { StoredVmSpec } from '../../domain/vm/spec.js';
import { vmAggregate } from '../../domain/vm/vm.aggregate.js';
import type { Endpoint } from '../../domain/vm/vm.events.js';
import type { SecretBox } from '../../domain/secret-box.port.js';
import { bindAggregate, type BoundOf, type CommandHandler, type CommandMeta } from '../command-handler.js';

export interface IngressSettings {
  /** What follows `{port}-{vm_id}.` in a published URL, port included when not the scheme's default: `localhost:8081`, `sbx.example.com`. */
  readonly domain: string;
  /** The scheme clients use (https behind a TLS-terminating load balancer). */
  readonly scheme: 'http' | 'https';
}

export const trafficTokenContext = (vmId: string): string => `traffic:${vmId}`;

export function hashTrafficToken(token: string): string {
  return createHash('sha256').update(token).digest('hex');
}

/** The stable URL of a VM's guest port: a pure function of the settings, so it survives every move of the VM. */
export function ingressUrl(settings: IngressSettings, vmId: string, port: number): string {
  return `${settings.scheme}://${port}-${vmId}.${settings.domain}`;
}

/** What the VM lifecycle flows (create, fork, migrate, destroy) ask of the ingress. */
export interface IngressPublisher {
  /**
   * Publishes a freshly booted VM's TCP endpoints with a new traffic token,
   * and returns the endpoints as clients are to see them (their ingress URLs).
   */
  publish(
    vm: { readonly vm_id: string; readonly tenant_id: string; readonly spec: Pick<StoredVmSpec, 'expose' | 'agent'> },
    hostId: string,
    endpoints: readonly Endpoint[],
    meta: CommandMeta,
  ): Promise<{ endpoints: Endpoint[]; url: string | undefined }>;
  /** The endpoints a migrated VM keeps showing: its ingress URLs when it has routes, else the host's as they are. */
  present(vmId: string, endpoints: readonly Endpoint[]): Promise<{ endpoints: Endpoint[]; url: string | undefined }>;
  /** Points the VM's routes at its new host, route by route on name (AdoptFrom). */
  adopt(vmId: string, hostId: string, endpoints: readonly Endpoint[], meta: CommandMeta): Promise<void>;
  unpublish(vmId: string, meta: CommandMeta): Promise<void>;
}

/**
 * The ingress side of the VM's stream: publish, adopt, unpublish (events the
 * route table is built from), the traffic token, and activity seen at the
 * proxies. Tokens are 32 random bytes; only their sha256 reaches the route
 * table, and the token itself is sealed for its owner.
 */
export class IngressCommands implements IngressPublisher {
  private readonly routes: BoundOf<typeof ingressAggregate>;

  constructor(
    handler: CommandHandler,
    private readonly secrets: SecretBox,
    readonly settings: IngressSettings,
    private readonly logger: Logger,
  ) {
    this.routes = bindAggregate(handler, ingressAggregate);
  }

  async publish(
    vm: { readonly vm_id: string; readonly tenant_id: string; readonly spec: Pick<StoredVmSpec, 'expose' | 'agent'> },
    hostId: string,
    endpoints: readonly Endpoint[],
    meta: CommandMeta,
  ): Promise<{ endpoints: Endpoint[]; url: string | undefined }> {
    const publicPorts = new Set([...(vm.spec.expose ?? []), ...(vm.spec.agent?.expose ?? [])].filter((e) => e.public).map((e) => e.as));
    const routes: IngressRoute[] = endpoints
      .filter((e) => (e.protocol ?? 'tcp') === 'tcp')
      .map((e) => ({ as: e.as, port: e.port, public: publicPorts.has(e.as), target: e.url }));
    const token = randomBytes(32).toString('base64url');
    await this.run(
      vm.vm_id,
      {
        type: 'PublishRoutes',
        data: {
          vm_id: vm.vm_id,
          tenant_id: vm.tenant_id,
          host_id: hostId,
          routes,
          token_sha256: hashTrafficToken(token),
          token_encrypted: this.secrets.seal(token, trafficTokenContext(vm.vm_id)),
        },
      },
      meta,
    );
    return this.shown(vm.vm_id, endpoints);
  }

  async present(vmId: string, endpoints: readonly Endpoint[]): Promise<{ endpoints: Endpoint[]; url: string | undefined }> {
    const { state } = await this.routes.load(vmId);
    return state.status === 'published' ? this.shown(vmId, endpoints) : { endpoints: [...endpoints], url: undefined };
  }

  async adopt(vmId: string, hostId: string, endpoints: readonly Endpoint[], meta: CommandMeta): Promise<void> {
    const targets = endpoints.filter((e) => (e.protocol ?? 'tcp') === 'tcp').map((e) => ({ as: e.as, target: e.url }));
    await this.run(vmId, { type: 'AdoptRoutes', data: { vm_id: vmId, host_id: hostId, targets } }, meta);
  }

  async unpublish(vmId: string, meta: CommandMeta): Promise<void> {
    await this.run(vmId, { type: 'UnpublishRoutes', data: { vm_id: vmId } }, meta);
  }

  /** The VM's traffic token and routes for its owner; `INGRESS_NOT_PUBLISHED` (404) for a VM without routes. */
  async grant(vmId: string): Promise<{ token: string; routes: Array<{ as: string; port: number; public: boolean; url: string }> }> {
    const { state } = await this.routes.load(vmId);
    if (state.status !== 'published' || state.vm_ended)
      throw new NotFoundError('INGRESS_NOT_PUBLISHED', `vm ${vmId} has no published ingress routes`, { vm_id: vmId });
    let token: string;
    try {
      token = this.secrets.open(state.token_encrypted, trafficTokenContext(vmId));
    } catch {
      throw new AppError(
        'VM_SECRETS_UNREADABLE',
        500,
        `vm ${vmId}: its traffic token does not decrypt with the configured TOKEN_ENCRYPTION_KEY`,
      );
    }
    return {
      token,
      routes: state.routes.map((r) => ({ as: r.as, port: r.port, public: r.public, url: ingressUrl(this.settings, vmId, r.port) })),
    };
  }

  private shown(vmId: string, endpoints: readonly Endpoint[]): { endpoints: Endpoint[]; url: string | undefined } {
    const shown = endpoints.map((e) =>
      (e.protocol ?? 'tcp') === 'tcp' ? { ...e, url: ingressUrl(this.settings, vmId, e.port) } : { ...e },
    );
    return { endpoints: shown, url: shown.find((e) => (e.protocol ?? 'tcp') === 'tcp')?.url };
  }

  private async run(vmId: string, command: IngressCommand, meta: CommandMeta): Promise<IngressState> {
    const r = await this.routes.handle(vmId, command, meta);
    this.logger.debug({ vm_id: vmId, command: command.type, events: r.events.length }, 'ingress routes');
    return r.state;
  }
}

/**
 * Traffic through the proxies counts as use for idle expiry: one
 * VmActivityRecorded per call (the proxies call it once per VM per flush,
 * never per request). A VM that no longer runs has nothing to record.
 */
export function activityRecorder(handler: CommandHandler, meta: CommandMeta): (vmId: string) => Promise<void> {
  const vms = bindAggregate(handler, vmAggregate);
  return async (vmId) => {
    try {
      await vms.handle(vmId, { type: 'RecordActivity', data: { vm_id: vmId } }, meta);
    } catch (err) {
      if (err instanceof AppError && (err.code === 'VM_INVALID_STATE' || err.code === 'VM_NOT_FOUND')) return;
      throw err;
    }
  };
}
