import {
  type AgentSpec,
  type PauseVmRequest,
  type RestoreVmRequest,
  type ArtifactMove,
  type ArtifactMoved,
  type AttachStart,
  type CapacityResponse,
  type Checkpoint,
  type CreateCheckpointRequest,
  type LayerUsageResponse,
  type CreateVmRequest,
  type DestroyVmResponse,
  type ExecRequest,
  type ExecResult,
  type ExecStreamStart,
  type GrantResponse,
  type NetworkReassertResponse,
  type PruneResponse,
  type StartAgentResponse,
  type UploadResponse,
  type VmInfo,
  type AgentEgress,
  type EgressStatus,
  type HostMetricsResponse,
  type LogsResponse,
  type MetricsResponse,
  type AbortedMigration,
  type IncomingMigration,
  type IncomingMigrationRequest,
  type MigrationOffer,
  type MigrationReport,
  type SendMigrationRequest,
} from '@fleet/agent-protocol';
import {
  type AgentStream,
  type CallOptions,
  type FileDownload,
  type HostAgent,
  type HostAgentConnector,
  type HostAgentEndpoint,
  type StreamOptions,
  type EnvdRequest,
  type EnvdResponse,
  type LazyCreateVmRequest,
  type MemoryStatus,
} from '../domain/host-agent.port.js';
import { AgentTransport, type HostAgentClientOptions } from './host-agent-client/transport.js';
import { VmRoutes } from './host-agent-client/vms.js';
import { ExecRoutes } from './host-agent-client/exec.js';
import { FileRoutes } from './host-agent-client/files.js';
import { CheckpointRoutes } from './host-agent-client/checkpoints.js';
import { HostRoutes } from './host-agent-client/host.js';
import { ObserveRoutes } from './host-agent-client/observe.js';
import { EgressRoutes } from './host-agent-client/egress.js';
import { EnvdRoutes } from './host-agent-client/envd.js';
import { MigrationRoutes } from './host-agent-client/migration.js';
import { LazyRoutes } from './host-agent-client/lazy.js';

export type { ClientLogger, HostAgentClientOptions } from './host-agent-client/transport.js';
export { errorFromAgent, fileTooLarge } from './host-agent-client/agent-errors.js';

/** Typed client for one host agent. Implements the control plane's HostAgent port; each route group's calls live in ./host-agent-client/. */
export class HostAgentClient implements HostAgent {
  readonly hostId: string;
  readonly #transport: AgentTransport;
  readonly #vms: VmRoutes;
  readonly #exec: ExecRoutes;
  readonly #files: FileRoutes;
  readonly #checkpoints: CheckpointRoutes;
  readonly #host: HostRoutes;
  readonly #observe: ObserveRoutes;
  readonly #egress: EgressRoutes;
  readonly #envd: EnvdRoutes;
  readonly #migration: MigrationRoutes;
  readonly #lazy: LazyRoutes;

  constructor(opts: HostAgentClientOptions) {
    this.#transport = new AgentTransport(opts);
    this.hostId = this.#transport.hostId;
    this.#vms = new VmRoutes(this.#transport);
    this.#exec = new ExecRoutes(this.#transport);
    this.#files = new FileRoutes(this.#transport);
    this.#checkpoints = new CheckpointRoutes(this.#transport);
    this.#host = new HostRoutes(this.#transport);
    this.#observe = new ObserveRoutes(this.#transport);
    this.#egress = new EgressRoutes(this.#transport);
    this.#envd = new EnvdRoutes(this.#transport);
    this.#migration = new MigrationRoutes(this.#transport);
    this.#lazy = new LazyRoutes(this.#transport);
  }

  capacity(opts?: CallOptions): Promise<CapacityResponse> {
    return this.#host.capacity(opts);
  }

  createVm(req: CreateVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#vms.createVm(req, opts);
  }

  getVm(name: string, opts?: CallOptions): Promise<VmInfo> {
    return this.#vms.getVm(name, opts);
  }

  listVms(prefix = '', opts?: CallOptions): Promise<VmInfo[]> {
    return this.#vms.listVms(prefix, opts);
  }

  destroyVm(name: string, opts?: CallOptions & { force?: boolean }): Promise<DestroyVmResponse> {
    return this.#vms.destroyVm(name, opts);
  }

  /** The tail of the sandbox's serial-style init log (not part of the HostAgent port). */
  consoleLog(name: string, tailBytes?: number, opts?: CallOptions): Promise<string> {
    return this.#observe.consoleLog(name, tailBytes, opts);
  }

  /** Resource samples of a sandbox after `sinceMs` (observability; not part of the HostAgent port). */
  metrics(name: string, sinceMs = 0, opts?: CallOptions): Promise<MetricsResponse> {
    return this.#observe.metrics(name, sinceMs, opts);
  }

  /** Aggregates over every sandbox of the host. */
  hostMetrics(opts?: CallOptions): Promise<HostMetricsResponse> {
    return this.#observe.hostMetrics(opts);
  }

  /** The console log from a byte offset (or its tail); readable after the sandbox ended, for the agent's retention. */
  logs(name: string, q: { offset?: number; tailBytes?: number; maxBytes?: number }, opts?: CallOptions): Promise<LogsResponse> {
    return this.#observe.logs(name, q, opts);
  }

  exec(name: string, req: ExecRequest, opts?: CallOptions): Promise<ExecResult> {
    return this.#exec.exec(name, req, opts);
  }

  execStream(name: string, start: ExecStreamStart, opts?: StreamOptions): Promise<AgentStream> {
    return this.#exec.execStream(name, start, opts);
  }

  attach(name: string, start: AttachStart, opts?: StreamOptions): Promise<AgentStream> {
    return this.#exec.attach(name, start, opts);
  }

  upload(
    name: string,
    path: string,
    data: Uint8Array | AsyncIterable<Uint8Array>,
    opts?: CallOptions & { mode?: string },
  ): Promise<UploadResponse> {
    return this.#files.upload(name, path, data, opts);
  }

  /** The whole file in memory, for small files (tests, tools): refused above `maxBytes` (default 64 MiB) before transfer. */
  download(name: string, path: string, opts?: CallOptions & { maxBytes?: number }): Promise<Uint8Array> {
    return this.#files.download(name, path, opts);
  }

  openDownload(name: string, path: string, opts?: CallOptions & { maxBytes?: number }): Promise<FileDownload> {
    return this.#files.openDownload(name, path, opts);
  }

  setEgress(name: string, egress: AgentEgress, opts?: CallOptions): Promise<VmInfo> {
    return this.#egress.setEgress(name, egress, opts);
  }

  egressStatus(name: string, opts?: CallOptions): Promise<EgressStatus> {
    return this.#egress.egressStatus(name, opts);
  }

  /** A plain node:http exchange, not fetch: fetch would decompress a gzip answer and a relay must pass bytes through as sent. */
  envd(name: string, req: EnvdRequest): Promise<EnvdResponse> {
    return this.#envd.envd(name, req);
  }

  startAgent(name: string, spec: AgentSpec, opts?: CallOptions): Promise<StartAgentResponse> {
    return this.#envd.startAgent(name, spec, opts);
  }

  checkpoint(name: string, req: CreateCheckpointRequest, opts?: CallOptions): Promise<Checkpoint> {
    return this.#checkpoints.checkpoint(name, req, opts);
  }

  layerUsage(name: string, opts?: CallOptions): Promise<LayerUsageResponse> {
    return this.#checkpoints.layerUsage(name, opts);
  }

  listCheckpoints(opts?: CallOptions): Promise<Checkpoint[]> {
    return this.#checkpoints.listCheckpoints(opts);
  }

  deleteCheckpoint(id: string, opts?: CallOptions): Promise<{ id: string; deleted: boolean }> {
    return this.#checkpoints.deleteCheckpoint(id, opts);
  }

  grantArtifact(snapshotId: string, ttlSeconds?: number, opts?: CallOptions): Promise<GrantResponse> {
    return this.#checkpoints.grantArtifact(snapshotId, ttlSeconds, opts);
  }

  pullArtifact(move: ArtifactMove, opts?: CallOptions): Promise<ArtifactMoved> {
    return this.#checkpoints.pullArtifact(move, opts);
  }

  pauseVm(name: string, req: PauseVmRequest = {}, opts?: CallOptions): Promise<{ vm: VmInfo; checkpoint: Checkpoint }> {
    return this.#checkpoints.pauseVm(name, req, opts);
  }

  resumeVm(name: string, opts?: CallOptions): Promise<VmInfo> {
    return this.#checkpoints.resumeVm(name, opts);
  }

  restoreVm(name: string, req: RestoreVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#checkpoints.restoreVm(name, req, opts);
  }

  migrationOffer(name: string, opts?: CallOptions): Promise<MigrationOffer> {
    return this.#migration.migrationOffer(name, opts);
  }

  prepareIncoming(req: IncomingMigrationRequest, opts?: CallOptions): Promise<IncomingMigration> {
    return this.#migration.prepareIncoming(req, opts);
  }

  abortIncoming(name: string, opts?: CallOptions): Promise<AbortedMigration> {
    return this.#migration.abortIncoming(name, opts);
  }

  sendMigration(name: string, req: SendMigrationRequest, opts?: CallOptions): Promise<MigrationReport> {
    return this.#migration.sendMigration(name, req, opts);
  }

  completeIncoming(name: string, req: { keep_paused: boolean }, opts?: CallOptions): Promise<VmInfo> {
    return this.#migration.completeIncoming(name, req, opts);
  }

  lazyPauseVm(name: string, req: PauseVmRequest = {}, opts?: CallOptions): Promise<{ vm: VmInfo; checkpoint: Checkpoint }> {
    return this.#lazy.lazyPauseVm(name, req, opts);
  }

  createLazyVm(req: LazyCreateVmRequest, opts?: CallOptions): Promise<VmInfo> {
    return this.#lazy.createLazyVm(req, opts);
  }

  memoryStatus(name: string, opts?: CallOptions): Promise<MemoryStatus> {
    return this.#lazy.memoryStatus(name, opts);
  }

  lazyPages(checkpointId: string, opts?: CallOptions): Promise<{ pinned: boolean; streaming: boolean }> {
    return this.#lazy.lazyPages(checkpointId, opts);
  }

  releaseLazyPages(checkpointId: string, opts?: CallOptions): Promise<{ released: boolean }> {
    return this.#lazy.releaseLazyPages(checkpointId, opts);
  }

  prune(opts?: CallOptions): Promise<PruneResponse> {
    return this.#host.prune(opts);
  }

  reassertNetwork(opts?: CallOptions): Promise<NetworkReassertResponse> {
    return this.#host.reassertNetwork(opts);
  }
}

/** Builds clients for hosts; the control plane keeps one per host. */
export class HostAgentClientFactory implements HostAgentConnector {
  constructor(private readonly defaults: Omit<HostAgentClientOptions, keyof HostAgentEndpoint> = {}) {}
  connect(endpoint: HostAgentEndpoint): HostAgentClient {
    return new HostAgentClient({ ...this.defaults, ...endpoint });
  }
}
