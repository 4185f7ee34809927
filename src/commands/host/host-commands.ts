import { z } from 'zod';
import { bindAggregate, type BoundOf } from '../command-handler.js';
import { hostAggregate } from '../../domain/host/host.aggregate.js';
import { capacityOverridesSchema, hostBackendSchema, labelsSchema, type HostEvent } from '../../domain/host/host.events.js';
import { type HostCommand, type HostState } from '../../domain/host/host.decider.js';
import { idSchema } from '../../domain/ids.js';
import { AppError, NotFoundError } from '@fleet/agent-protocol';
import type { HostAgent, HostAgentConnector } from '../../domain/host-agent.port.js';
import type { SecretBox } from '../../domain/secret-box.port.js';
import type { CapacityResponse } from '@fleet/agent-protocol';
import type { HostCapacity } from '@fleet/agent-protocol';
import type { Position } from '../../domain/event-store.port.js';
import { CommandHandler, type CommandMeta, type Handled } from '../command-handler.js';

export const registerHostRequestSchema = z
  .object({
    id: idSchema,
    url: z.url().refine((u) => /^https?:\/\//.test(u), 'must be an http(s) URL of the host agent'),
    token: z.string().min(16, 'the host agent bearer token: at least 16 characters'),
    region: z.string().max(64).default(''),
    backend: hostBackendSchema.default('process'),
    labels: labelsSchema.default({}),
    /** Operator overrides applied over what the agent reports (e.g. to hold back headroom, or declare GPU kind). */
    capacity_overrides: capacityOverridesSchema.default({}),
  })
  .strict();
export type RegisterHostRequest = z.input<typeof registerHostRequestSchema>;

/**
 * Token context binds a sealed host token to its host and the URL it is sent
 * to: copied onto another host's record, or left on a record whose URL was
 * changed to point elsewhere, it does not open.
 */
export const hostTokenContext = (hostId: string, url: string): string => `host:${hostId}:${url}`;
/** The context before the URL was bound: accepted once per host, then the token is sealed again under the current one. */
export const legacyHostTokenContext = (hostId: string): string => `host:${hostId}`;

export interface HostResult {
  readonly state: HostState;
  readonly position: Position | undefined;
}

/**
 * Host registry commands (admin only, checked at the edge). The agent's
 * token is sealed before it enters an event; every later call opens it to
 * build the host's client (the seed's HostProviderFactory, from events).
 */
export class HostCommands {
  private readonly agents = new Map<string, { sealed: string; url: string; agent: HostAgent }>();
  private resealing: Promise<void> = Promise.resolve();
  private readonly listeners: Array<(hostId: string, state: HostState, revision: bigint | 'no_stream') => void> = [];

  private readonly hostHandler: BoundOf<typeof hostAggregate>;

  constructor(
    private readonly handler: CommandHandler,
    private readonly connector: HostAgentConnector,
    private readonly secrets: SecretBox,
    /** The fleet's CPU overcommit ratio, for hosts registered without their own. */
    private readonly defaultCpuOvercommitRatio = 1,
  ) {
    this.hostHandler = bindAggregate(handler, hostAggregate);
  }

  async register(input: unknown, meta: CommandMeta): Promise<HostResult> {
    const req = registerHostRequestSchema.parse(input);
    // Probe first: a host whose agent does not answer with this token is not registered at all.
    const agent = this.connector.connect({ hostId: req.id, url: req.url, token: req.token });
    const probed = toHostCapacity(await agent.capacity({ timeoutMs: 10_000 }));
    const sealed = this.secrets.seal(req.token, hostTokenContext(req.id, req.url));
    const r = await this.run(
      req.id,
      {
        type: 'RegisterHost',
        data: {
          host_id: req.id,
          url: req.url,
          region: req.region,
          backend: req.backend,
          labels: req.labels,
          probed_capacity: probed,
          overrides: req.capacity_overrides,
          default_cpu_overcommit_ratio: this.defaultCpuOvercommitRatio,
          token_encrypted: sealed,
        },
      },
      meta,
    );
    this.agents.delete(req.id);
    return r;
  }

  async probe(hostId: string, meta: CommandMeta): Promise<HostResult> {
    const agent = await this.agentFor(hostId);
    const probed = toHostCapacity(await agent.capacity());
    return this.run(hostId, { type: 'ProbeHostCapacity', data: { host_id: hostId, probed_capacity: probed } }, meta);
  }

  cordon(hostId: string, reason: string | undefined, meta: CommandMeta): Promise<HostResult> {
    return this.run(hostId, { type: 'CordonHost', data: { host_id: hostId, reason } }, meta);
  }

  uncordon(hostId: string, meta: CommandMeta): Promise<HostResult> {
    return this.run(hostId, { type: 'UncordonHost', data: { host_id: hostId } }, meta);
  }

  deregister(hostId: string, force: boolean, meta: CommandMeta): Promise<HostResult> {
    return this.run(hostId, { type: 'DeregisterHost', data: { host_id: hostId, force } }, meta);
  }

  /**
   * Called with each host state this process appends, so a reader of this
   * process (the placement view) sees its own writes before the read model
   * does: a host registered here is placeable by the very next create.
   */
  onAppended(listener: (hostId: string, state: HostState, revision: bigint | 'no_stream') => void): void {
    this.listeners.push(listener);
  }

  async load(hostId: string): Promise<{ state: HostState; revision: bigint | 'no_stream' }> {
    return this.hostHandler.load(hostId);
  }

  /** The agent client for a registered host, rebuilt from its events after a restart. */
  async agentFor(hostId: string): Promise<HostAgent> {
    const { state } = await this.load(hostId);
    if (state.status === 'unregistered') throw new NotFoundError('HOST_NOT_FOUND', `host ${hostId} is not registered`, { host_id: hostId });
    return this.agentForState(state);
  }

  agentForState(state: Exclude<HostState, { status: 'unregistered' }>): HostAgent {
    const cached = this.agents.get(state.host_id);
    if (cached && cached.sealed === state.token_encrypted && cached.url === state.url) return cached.agent;
    let token: string;
    try {
      token = this.secrets.open(state.token_encrypted, hostTokenContext(state.host_id, state.url));
    } catch {
      try {
        token = this.secrets.open(state.token_encrypted, legacyHostTokenContext(state.host_id));
      } catch {
        throw new AppError(
          'HOST_TOKEN_UNREADABLE',
          500,
          `host ${state.host_id}: its stored token does not decrypt with the configured TOKEN_ENCRYPTION_KEY for its URL; re-register the host`,
        );
      }
      this.reseal(state.host_id, state.token_encrypted, token, state.url);
    }
    const agent = this.connector.connect({ hostId: state.host_id, url: state.url, token });
    this.agents.set(state.host_id, { sealed: state.token_encrypted, url: state.url, agent });
    return agent;
  }

  /** Best effort, in the background: until it lands, the old context is accepted again (the decider makes a repeat a no-op). */
  private reseal(hostId: string, previous: string, token: string, url: string): void {
    const token_encrypted = this.secrets.seal(token, hostTokenContext(hostId, url));
    this.resealing = this.resealing
      .then(() =>
        this.run(
          hostId,
          { type: 'ResealHostToken', data: { host_id: hostId, previous, token_encrypted } },
          { correlationId: `reseal-${hostId}`, actor: 'system', tenantId: 'admin' },
        ),
      )
      .then(
        () => undefined,
        () => undefined,
      );
  }

  /** Settles once every reseal started so far has been written (or given up). */
  resealed(): Promise<void> {
    return this.resealing;
  }

  private async run(hostId: string, command: HostCommand, meta: CommandMeta): Promise<HostResult> {
    const r: Handled<HostState, HostEvent> = await this.hostHandler.handle(hostId, command, meta);
    if (r.events.length > 0) for (const listener of this.listeners) listener(hostId, r.state, r.revision);
    return { state: r.state, position: r.position };
  }
}

export function toHostCapacity(c: CapacityResponse): HostCapacity {
  const { backend: _b, vms_running: _v, ...capacity } = c;
  return capacity;
}
