import type { HostMetricsResponse, LogsResponse, MetricsResponse } from '@fleet/agent-protocol';
import type {
  AgentSpec,
  PauseVmRequest,
  RestoreVmRequest,
  ArtifactMove,
  ArtifactMoved,
  AttachStart,
  CapacityResponse,
  Checkpoint,
  ClientFrame,
  CreateCheckpointRequest,
  LayerUsageResponse,
  CreateVmRequest,
  DestroyVmResponse,
  ExecRequest,
  ExecResult,
  ExecStreamStart,
  GrantResponse,
  NetworkReassertResponse,
  PruneResponse,
  ServerFrame,
  StartAgentResponse,
  UploadResponse,
  VmInfo,
  AgentEgress,
  EgressStatus,
  AbortedMigration,
  IncomingMigration,
  IncomingMigrationRequest,
  MigrationOffer,
  MigrationReport,
  SendMigrationRequest,
} from '@fleet/agent-protocol';
import { AppError, NotFoundError, UnavailableError } from '@fleet/agent-protocol';

/**
 * The port the control plane's command handlers drive one host agent
 * through. The HTTP client (src/adapters/host-agent.client.ts) implements
 * it; exec and file traffic may later move to a direct channel to the
 * sandbox behind this same port.
 *
 * Errors: every method throws an AppError. Use `classifyHostAgentError` to
 * decide what to do:
 * - 'capacity'  — HostCapacityError (HOST_CAPACITY_EXHAUSTED): the host
 *                 refused for lack of room. Re-place elsewhere; do not count
 *                 a host failure.
 * - 'host'      — HostUnreachableError (HOST_UNREACHABLE: network error,
 *                 timeout) or HostAgentError (AGENT_ERROR: 5xx, malformed
 *                 answer). Count it, classify it, exclude the host from the
 *                 retry.
 * - 'not_found' — NotFoundError with SANDBOX_NOT_FOUND, CHECKPOINT_NOT_FOUND,
 *                 IMAGE_NOT_FOUND, GUEST_PATH_NOT_FOUND.
 * - 'rejected'  — any other 4xx AppError (ValidationError VALIDATION_FAILED /
 *                 INVALID_SANDBOX_SPEC, ConflictError SANDBOX_EXISTS /
 *                 SANDBOX_NOT_RUNNING / CHECKPOINT_EXISTS, PATH_ESCAPES_SANDBOX,
 *                 ARTIFACT_DIGEST_MISMATCH (422), ARTIFACT_TRANSFER_FAILED (424:
 *                 the SOURCE peer failed or refused the grant; this host is
 *                 fine), GRANT_*): retrying the same call will not help.
 */
export interface HostAgent {
  capacity(opts?: CallOptions): Promise<CapacityResponse>;

  /** Boots a sandbox from `image` or from `checkpoint_id` (in this host's store). */
  createVm(req: CreateVmRequest, opts?: CallOptions): Promise<VmInfo>;
  getVm(name: string, opts?: CallOptions): Promise<VmInfo>;
  listVms(prefix?: string, opts?: CallOptions): Promise<VmInfo[]>;
  /** Runs the drain command first unless `force`. Idempotent: a missing sandbox is NOT an error (destroyed: false). */
  destroyVm(name: string, opts?: CallOptions & { force?: boolean }): Promise<DestroyVmResponse>;

  /** A non-zero exit or a timeout is a result (exit_code, timed_out), not an error. */
  exec(name: string, req: ExecRequest, opts?: CallOptions): Promise<ExecResult>;

  /** Observability (optional: a test double may leave them out; the routes then answer 501). */
  metrics?(name: string, sinceMs?: number, opts?: CallOptions): Promise<MetricsResponse>;
  hostMetrics?(opts?: CallOptions): Promise<HostMetricsResponse>;
  logs?(name: string, q: { offset?: number; tailBytes?: number; maxBytes?: number }, opts?: CallOptions): Promise<LogsResponse>;
  /** Streaming exec over a websocket: frames in both directions until `exit`. */
  execStream(name: string, start: ExecStreamStart, opts?: StreamOptions): Promise<AgentStream>;
  /** Interactive attach (optionally with a TTY; resize with a `resize` frame). */
  attach(name: string, start: AttachStart, opts?: StreamOptions): Promise<AgentStream>;

  /** `data` may be a stream: it is sent as it comes, never collected first, and never retried. */
  upload(
    name: string,
    path: string,
    data: Uint8Array | AsyncIterable<Uint8Array>,
    opts?: CallOptions & { mode?: string },
  ): Promise<UploadResponse>;
  /**
   * Opens a file for reading: answers once the agent has announced the size, before any byte moves;
   * a file larger than `maxBytes` is refused then (FILE_TOO_LARGE, 413). The bytes are read once, as
   * the reader takes them; `cancel` stops the transfer.
   */
  openDownload(name: string, path: string, opts?: CallOptions & { maxBytes?: number }): Promise<FileDownload>;

  /**
   * One HTTP exchange with the sandbox's envd (the E2B SDK's in-sandbox API: Connect RPC, /files,
   * /health), streamed both ways and passed through unchanged: status, headers and body are envd's.
   * Rejects only when the agent cannot be reached (HostUnreachableError).
   */
  envd(name: string, req: EnvdRequest): Promise<EnvdResponse>;

  startAgent(name: string, spec: AgentSpec, opts?: CallOptions): Promise<StartAgentResponse>;

  /** `kind` in the answer is what the backend produced (a live request may come back as disk). */
  checkpoint(name: string, req: CreateCheckpointRequest, opts?: CallOptions): Promise<Checkpoint>;
  /** The sandbox's writable layer: bytes used, its disk size, and the expected size of a checkpoint of it. */
  layerUsage(name: string, opts?: CallOptions): Promise<LayerUsageResponse>;
  listCheckpoints(opts?: CallOptions): Promise<Checkpoint[]>;
  /** Idempotent: deleting a missing checkpoint answers deleted: false. */
  deleteCheckpoint(id: string, opts?: CallOptions): Promise<{ id: string; deleted: boolean }>;

  /** Mints a short-lived grant a peer presents to read one snapshot's files from THIS host. */
  grantArtifact(snapshotId: string, ttlSeconds?: number, opts?: CallOptions): Promise<GrantResponse>;
  /** Asks THIS host to pull a snapshot from `move.from`, verify it and commit it atomically. */
  pullArtifact(move: ArtifactMove, opts?: CallOptions): Promise<ArtifactMoved>;

  /** Memory checkpoint, then the sandbox's processes stop (state paused); MEMORY_CHECKPOINT_UNSUPPORTED without CRIU. */
  pauseVm(name: string, req?: PauseVmRequest, opts?: CallOptions): Promise<{ vm: VmInfo; checkpoint: Checkpoint }>;
  /** Resumes a paused sandbox where it stopped. Idempotent. */
  resumeVm(name: string, opts?: CallOptions): Promise<VmInfo>;
  /** Back to a checkpoint on this host (live: its processes resume; disk: a cold boot over its layer). */
  restoreVm(name: string, req: RestoreVmRequest, opts?: CallOptions): Promise<VmInfo>;

  /**
   * Native live migration (qemu agents; agent-protocol migration.ts), optional: a test double may
   * leave them out. Offer (source), incoming (target: a listener and a fresh key), send (source:
   * the guest streams there and stays stopped here), complete (target: the guest runs), or abort
   * (target: what was prepared goes).
   */
  migrationOffer?(name: string, opts?: CallOptions): Promise<MigrationOffer>;
  prepareIncoming?(req: IncomingMigrationRequest, opts?: CallOptions): Promise<IncomingMigration>;
  sendMigration?(name: string, req: SendMigrationRequest, opts?: CallOptions): Promise<MigrationReport>;
  /** The target gives up a prepared migration that has not completed (idempotent). */
  abortIncoming?(name: string, opts?: CallOptions): Promise<AbortedMigration>;
  completeIncoming?(name: string, req: { keep_paused: boolean }, opts?: CallOptions): Promise<VmInfo>;

  /**
   * Lazy (post-copy) moves between two agents (optional: a test double may leave them out; an agent whose host cannot
   * answers LAZY_PAGES_UNSUPPORTED). Source: a pause whose memory pages stay pinned in a page server until the target
   * has them all (`lazyPages`, `releaseLazyPages` ends them: the target then loses the VM). Target: a restore that runs
   * before its memory is there (`createLazyVm`), paging it in from the source under the artifact grant (`memoryStatus`).
   */
  lazyPauseVm?(name: string, req?: PauseVmRequest, opts?: CallOptions): Promise<{ vm: VmInfo; checkpoint: Checkpoint }>;
  createLazyVm?(req: LazyCreateVmRequest, opts?: CallOptions): Promise<VmInfo>;
  memoryStatus?(name: string, opts?: CallOptions): Promise<MemoryStatus>;
  lazyPages?(checkpointId: string, opts?: CallOptions): Promise<{ pinned: boolean; streaming: boolean }>;
  releaseLazyPages?(checkpointId: string, opts?: CallOptions): Promise<{ released: boolean }>;

  /** Reclaims leftovers (mounts, cgroups, links, dirs) no known sandbox owns. */
  prune(opts?: CallOptions): Promise<PruneResponse>;

  /** Re-applies the host's sandbox network boundary (firewall, per-link sysctls); `repaired` counts what had drifted. */
  reassertNetwork(opts?: CallOptions): Promise<NetworkReassertResponse>;

  /** Replaces a running sandbox's outbound policy (idempotent). */
  setEgress(name: string, egress: AgentEgress, opts?: CallOptions): Promise<VmInfo>;
  /** The resolved outbound policy, with a probe of its proxy endpoint from the host. */
  egressStatus(name: string, opts?: CallOptions): Promise<EgressStatus>;
}

/** The seed's MemoryStatus of a sandbox on its host (chunks are pages); a sandbox not restored lazily is all resident. */
export interface MemoryStatus {
  readonly resident_chunks: number;
  readonly total_chunks: number;
  readonly done: boolean;
  readonly error?: string | undefined;
}

/** A lazy restore: the VM's create request, the pulled checkpoint, and where its pages are served (the source agent, a grant). */
export type LazyCreateVmRequest = CreateVmRequest & {
  readonly checkpoint_id: string;
  readonly from: { readonly url: string; readonly grant: string };
};

export interface EnvdRequest {
  readonly method: string;
  /** envd's own path and query, e.g. `/process.Process/Start` or `/files?path=a.txt`. */
  readonly path: string;
  readonly headers: Readonly<Record<string, string>>;
  /** Absent for GET and HEAD. */
  readonly body?: AsyncIterable<Uint8Array> | undefined;
  /** Aborting it drops the exchange (the client went away). */
  readonly signal?: AbortSignal | undefined;
}

export interface EnvdResponse {
  readonly status: number;
  readonly headers: Readonly<Record<string, string | string[]>>;
  readonly body: AsyncIterable<Uint8Array>;
}

export interface CallOptions {
  /** Overrides the client's per-call default. */
  timeoutMs?: number;
  signal?: AbortSignal;
}

export interface StreamOptions {
  /** Bounds only the websocket handshake and the `started`/`error` answer. */
  connectTimeoutMs?: number;
  signal?: AbortSignal;
}

/**
 * A live exec/attach session. `frames` yields every agent frame and ends
 * after `exit` (or `error`, or the connection closing); a dropped connection
 * ends it with a HostUnreachableError. Frames are the protocol's JSON
 * objects, so a control plane can relay them to its own websocket clients
 * unchanged.
 */
export interface AgentStream {
  readonly frames: AsyncIterable<ServerFrame>;
  send(frame: ClientFrame): void;
  /** Convenience for `send({type:'stdin', data: base64})`. */
  write(data: Uint8Array | string): void;
  /** Closes the session; the process inside is killed by the agent. */
  close(): void;
  /** Bytes sent towards the agent and not yet on the wire: the relay stops reading its client above a mark. */
  bufferedAmount(): number;
}

/** A file on its way out of a sandbox. */
export interface FileDownload {
  readonly size: number;
  /** Ends early with an error when the transfer breaks or the file outgrows `size` or the cap. */
  readonly body: AsyncIterable<Uint8Array>;
  cancel(): void;
}

/** Where a host's agent is and how to authenticate to it. */
export interface HostAgentEndpoint {
  hostId: string;
  url: string;
  token: string;
}

/** Builds a HostAgent for one host (the control plane holds many). */
export interface HostAgentConnector {
  connect(endpoint: HostAgentEndpoint): HostAgent;
}

// ---- error classification ---------------------------------------------------

/** The host refused for capacity: re-place elsewhere, not a host failure. */
export class HostCapacityError extends AppError {
  constructor(message: string, details?: Record<string, unknown>) {
    super('HOST_CAPACITY_EXHAUSTED', 507, message, details);
  }
}

/** The host could not be reached or did not answer in time. */
export class HostUnreachableError extends UnavailableError {
  constructor(message: string, details?: Record<string, unknown>, options?: { cause?: unknown }) {
    super('HOST_UNREACHABLE', message, details, options);
  }
}

/** The host answered but failed (5xx, or a malformed answer). */
export class HostAgentError extends AppError {
  constructor(message: string, details?: Record<string, unknown>, options?: { cause?: unknown }) {
    super('AGENT_ERROR', 502, message, details, options);
  }
}

export type HostAgentErrorClass = 'capacity' | 'host' | 'not_found' | 'rejected';

export function classifyHostAgentError(err: unknown): HostAgentErrorClass {
  if (err instanceof AppError) {
    if (err.code === 'HOST_CAPACITY_EXHAUSTED') return 'capacity';
    if (err.code === 'HOST_UNREACHABLE' || err.code === 'AGENT_ERROR' || err.status >= 500) return 'host';
    if (err instanceof NotFoundError || err.status === 404) return 'not_found';
    return 'rejected';
  }
  return 'host';
}
