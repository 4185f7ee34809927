import type { Readable, Writable } from 'node:stream';
import { AppError, ConflictError, NotFoundError, ValidationError } from '@fleet/agent-protocol';
import type { AgentEgress, AgentEgressParsed, EgressStatus, HostCapacity } from '@fleet/agent-protocol';
import type { SandboxObserver } from './observe.js';

/**
 * The host agent's sandbox runtime. The HTTP server (exec with timeouts and
 * output caps, streaming exec, attach, files, artifacts) is built on this
 * interface only; a backend knows nothing of HTTP.
 *
 * ## Constructing the `process` backend (packages/agent/src/backend/process/process-backend.ts)
 *
 *   const backend = await ProcessBackend.open({
 *     dataDir,            // AGENT_DATA_DIR: sandboxes/, checkpoints/, staging/ live here
 *     imageDir,           // AGENT_IMAGE_DIR: one directory per image name (see packages/agent/src/images.ts)
 *     subnet,             // AGENT_SUBNET, IPv4 CIDR, default "10.213.0.0/16"; the first address is the gateway
 *     bridgePrefix,       // AGENT_BRIDGE_PREFIX, [a-z0-9]{1,5}, e.g. "fb"; names every bridge, veth and cgroup
 *     maxSandboxes,       // AGENT_MAX_SANDBOXES: capacity().vm_count, and create refuses beyond it
 *     allowCrossTenant,   // AGENT_ALLOW_CROSS_TENANT: all tenants share one bridge when true
 *     publishHost,        // AGENT_PUBLISH_HOST: where endpoint proxies listen, default "127.0.0.1"
 *     advertiseHost,      // optional: host written into endpoint URLs (default publishHost, 127.0.0.1 for 0.0.0.0)
 *     defaultImage,       // AGENT_DEFAULT_IMAGE: image used when a spec names none, default "base"
 *     logger,             // optional pino logger
 *   });
 *   // open() calls recover(): sandboxes that survived an agent crash are listed again.
 *   // Design, isolation model and host requirements: packages/agent/src/backend/process/README.md
 *
 * Two agents on one machine (the integration tests) MUST use distinct dataDir,
 * subnet and bridgePrefix: bridges, routes and cgroups are host-global.
 *
 * ## Errors
 * Every failure is an AppError with a stable code (constants below). Exactly
 * one code means "this host refuses for capacity" (the control plane
 * re-places elsewhere without counting a failure): HOST_CAPACITY_EXHAUSTED
 * (status 507). Any other 5xx code means "this host failed".
 *
 * ## On-disk layout of a checkpoint (served and imported by the server)
 *
 *   <dataDir>/checkpoints/<id>/manifest.json
 *       { "id", "comment", "kind": "disk", "size_bytes", "digest",
 *         "created_at" (ISO 8601), "image", "files": {}, "parent": "" }
 *       digest = hex sha256 of rootfs.tar exactly as written (computed while
 *       writing); size_bytes = byte length of rootfs.tar.
 *   <dataDir>/checkpoints/<id>/rootfs.tar
 *       GNU tar (with xattrs) of the sandbox's writable overlay layer, paths
 *       relative to the layer root ("./…"), overlay whiteouts included.
 *   <dataDir>/checkpoints/<id>/criu-*      (kind "live" only)
 *       The memory half: CRIU's image files under a `criu-` prefix, and
 *       criu-fleet.json (what a restore needs besides them: the console's
 *       CRIU id, the external mounts, the id block, address and hostname it
 *       was taken under). Every one is in "files" with its sha256, so a move
 *       verifies and commits them with the rootfs (see process/criu.ts).
 *
 * Only directories holding a manifest.json are checkpoints. To import a
 * pulled checkpoint: stream files into a directory under
 * `backend.stagingDir()` (same filesystem as checkpoints/), verify, write
 * manifest.json last, then call `importCheckpoint(stagingPath)`, which
 * validates the manifest, re-checks the digest of rootfs.tar, and renames
 * the directory into place atomically (CHECKPOINT_EXISTS if the id is
 * taken; the staging directory is removed on any failure).
 */

export const BackendErrorCode = {
  SandboxNotFound: 'SANDBOX_NOT_FOUND',
  SandboxExists: 'SANDBOX_EXISTS',
  SandboxNotRunning: 'SANDBOX_NOT_RUNNING',
  ImageNotFound: 'IMAGE_NOT_FOUND',
  PathEscapesSandbox: 'PATH_ESCAPES_SANDBOX',
  GuestPathNotFound: 'GUEST_PATH_NOT_FOUND',
  CheckpointNotFound: 'CHECKPOINT_NOT_FOUND',
  CheckpointExists: 'CHECKPOINT_EXISTS',
  CheckpointCorrupt: 'CHECKPOINT_CORRUPT',
  /** The archive outgrew the bytes the caller allowed (its quota headroom). */
  CheckpointTooLarge: 'CHECKPOINT_TOO_LARGE',
  /** The one "refuses for capacity" code: re-place elsewhere, not a host failure. */
  HostCapacityExhausted: 'HOST_CAPACITY_EXHAUSTED',
  /** No free address left in the subnet: also capacity. */
  AddressPoolExhausted: 'HOST_CAPACITY_EXHAUSTED',
  InvalidSpec: 'INVALID_SANDBOX_SPEC',
  /** A host-side operation failed (mount, cgroup, netlink, spawn). */
  SandboxFailed: 'SANDBOX_FAILED',
  ExposePortUnavailable: 'EXPOSE_PORT_UNAVAILABLE',
  FeatureMissing: 'HOST_FEATURE_MISSING',
  /** A create names a GPU or MIG instance uuid this host does not offer (not probed here, or not usable). */
  GpuNotOnHost: 'GPU_NOT_ON_HOST',
  /** A create names a device another sandbox on this host is bound to. */
  GpuInUse: 'GPU_IN_USE',
  /** A create carries GPUs for a backend that cannot pass a device through (process). */
  GpuPassthroughUnsupported: 'GPU_PASSTHROUGH_UNSUPPORTED',
} as const;
export type BackendErrorCode = (typeof BackendErrorCode)[keyof typeof BackendErrorCode];

export const sandboxNotFound = (name: string): AppError =>
  new NotFoundError(BackendErrorCode.SandboxNotFound, `no sandbox named "${name}" on this host`, { name });
export const sandboxExists = (name: string): AppError =>
  new ConflictError(
    BackendErrorCode.SandboxExists,
    `a sandbox named "${name}" already exists on this host; destroy it or pick another name`,
    { name },
  );
export const sandboxNotRunning = (name: string): AppError =>
  new ConflictError(BackendErrorCode.SandboxNotRunning, `sandbox "${name}" is not running (its init exited); destroy and recreate it`, {
    name,
  });
export const imageNotFound = (image: string): AppError =>
  new NotFoundError(
    BackendErrorCode.ImageNotFound,
    `image "${image}" is not on this host; build it with \`npm run agent -- image build ${image}\``,
    { image },
  );
export const pathEscapes = (path: string): AppError =>
  new AppError(
    BackendErrorCode.PathEscapesSandbox,
    403,
    `path "${path}" escapes the sandbox root (through ".." or a symlink); use a path inside the sandbox`,
    { path },
  );
export const guestPathNotFound = (path: string): AppError =>
  new NotFoundError(BackendErrorCode.GuestPathNotFound, `no file at "${path}" in the sandbox`, { path });
export const checkpointNotFound = (id: string): AppError =>
  new NotFoundError(BackendErrorCode.CheckpointNotFound, `no checkpoint "${id}" on this host`, { id });
export const capacityExhausted = (what: string, details?: Record<string, unknown>): AppError =>
  new AppError(BackendErrorCode.HostCapacityExhausted, 507, `this host has no room: ${what}`, details);
export const invalidSpec = (message: string, fields: { path: string; message: string }[] = []): AppError =>
  new ValidationError(message, fields, BackendErrorCode.InvalidSpec);
export const sandboxFailed = (message: string, details?: Record<string, unknown>, cause?: unknown): AppError =>
  new AppError(BackendErrorCode.SandboxFailed, 500, message, details, { cause });
/** What a backend without device passthrough answers a create that carries GPUs: refused, never booted without them. */
export function gpuBindingRefusal(spec: Pick<CreateSpec, 'gpuUuids' | 'migInstanceUuids'>, backend: string): AppError | undefined {
  const n = (spec.gpuUuids?.length ?? 0) + (spec.migInstanceUuids?.length ?? 0);
  return n === 0
    ? undefined
    : new AppError(
        BackendErrorCode.GpuPassthroughUnsupported,
        409,
        `the ${backend} backend cannot pass a GPU or MIG instance through to a sandbox (${n} bound): only a qemu host can`,
        { backend },
      );
}
export const featureMissing = (feature: string, hint: string): AppError =>
  new AppError(BackendErrorCode.FeatureMissing, 500, `host feature missing: ${feature}; ${hint}`, { feature });

export type Protocol = 'tcp' | 'udp';

export interface ExposeSpec {
  /** Guest port. */
  readonly port: number;
  /** Caller's label, e.g. "http". */
  readonly as: string;
  /** Empty means tcp. */
  readonly protocol?: Protocol;
}

export interface Endpoint {
  readonly as: string;
  /** Reachable from the host, e.g. "tcp://127.0.0.1:41231" ("http://…" when as === "http"). */
  readonly url: string;
  /** The guest-side port this endpoint publishes. */
  readonly port: number;
  /** What was actually published on. */
  readonly protocol: Protocol;
  /** Host port the proxy listens on. */
  readonly host_port: number;
}

export interface CreateSpec {
  /** [a-z0-9][a-z0-9-]{0,62} */
  readonly name: string;
  /** Image name; omitted means the backend's default image. Exclusive with checkpointId. */
  readonly image?: string;
  /** Restore the writable layer of this checkpoint over the checkpoint's image. */
  readonly checkpointId?: string;
  readonly cpus: number;
  readonly ram_mb: number;
  readonly pids_max?: number;
  /** GiB of the sandbox's own disk for its writable layer (writes past it fail with ENOSPC inside); 0 or absent: none. */
  readonly storage_gb?: number;
  /** Network isolation unit; sandboxes of different tenants cannot reach each other. */
  readonly tenant: string;
  /** Honoured if free in the subnet, else the lowest free address. */
  readonly ipHint?: string;
  /** A cluster network to join: its members share a bridge of their own (process backend). */
  readonly network?: { readonly id: string; readonly subnet: string };
  /** With a live checkpointId: resume its processes (under this name, address and ids) instead of booting its rootfs. */
  readonly resume?: boolean;
  readonly expose?: readonly ExposeSpec[];
  /** Environment for every spawn in this sandbox (spawn's env overrides it). */
  readonly env?: Readonly<Record<string, string>>;
  /** Keep CAP_NET_RAW in the sandbox (raw sockets); dropped by default. */
  readonly net_raw?: boolean;
  /** Outbound policy; absent: none (what sandboxes had before egress; the control plane always sends one). */
  readonly egress?: AgentEgress;
  /** Whole GPUs bound by the control plane (capacity's `gpu_devices[].uuid`): only a backend that passes devices through takes them. */
  readonly gpuUuids?: readonly string[];
  /** MIG instances bound by the control plane (capacity's `mig_instances[].uuid`). */
  readonly migInstanceUuids?: readonly string[];
}

export type SandboxState = 'running' | 'stopped' | 'paused';

export interface SandboxInfo {
  readonly name: string;
  readonly state: SandboxState;
  readonly tenant: string;
  readonly image: string;
  /** Checkpoint it was restored from, "" if none. */
  readonly checkpoint_id: string;
  readonly ip: string;
  readonly mac: string;
  readonly cpus: number;
  readonly ram_mb: number;
  readonly pids_max: number;
  readonly created_at: string;
  /** Host pid of the sandbox's init (pid 1 inside), 0 when stopped. */
  readonly init_pid: number;
  readonly endpoints: readonly Endpoint[];
  /** The resolved outbound policy (backends without egress leave it out). */
  readonly egress?: EgressStatus;
  /** Host path of the serial-style log of the init's output. */
  readonly console_log: string;
}

export interface DestroyOptions {
  /** Run inside the guest (sh -c) before teardown; "" or absent skips. */
  readonly drainCommand?: string;
  /** Bound on the drain command and on the init's graceful exit. Default 5000. */
  readonly graceMs?: number;
}

export interface SpawnOptions {
  readonly argv: readonly string[];
  readonly env?: Readonly<Record<string, string>>;
  /** Guest working directory; default "/". */
  readonly cwd?: string;
  /** Run on a pseudo-terminal of this size (stdout carries the merged output; stderr stays empty). */
  readonly tty?: { readonly rows: number; readonly cols: number };
  /** false: the guest process reads EOF from stdin. */
  readonly stdin: boolean;
}

export interface ExitStatus {
  /** null when killed by a signal. */
  readonly exitCode: number | null;
  readonly signal: NodeJS.Signals | null;
}

export interface ProcessHandle {
  readonly stdout: Readable;
  readonly stderr: Readable;
  /** Ended immediately when spawned with stdin: false. */
  readonly stdin: Writable;
  /** No-op without a tty. */
  resize(rows: number, cols: number): void;
  /** Signals the guest process and everything in its process group. */
  kill(signal?: NodeJS.Signals): void;
  /** Resolves once the guest process exited and its output streams ended. */
  wait(): Promise<ExitStatus>;
}

export type CheckpointKind = 'disk' | 'live';

export interface Checkpoint {
  readonly id: string;
  readonly comment: string;
  readonly size_bytes: number;
  readonly created_at: string;
  /** hex sha256 of rootfs.tar, computed while writing. */
  readonly digest: string;
  /** What it actually contains: a live request on a disk-only backend yields 'disk'. */
  readonly kind: CheckpointKind;
  /** Memory files (name → hex sha256); {} for disk. */
  readonly files: Readonly<Record<string, string>>;
  readonly parent: string;
  /** How long the guest was frozen for it, when measured (live checkpoints, pauses). */
  readonly pause_ms?: number;
  /** Image the layer sits on; restore needs it on the target host. */
  readonly image: string;
}

export interface CheckpointOptions {
  readonly comment?: string;
  readonly live?: boolean;
  /** Chosen by the caller (the control plane's snapshot id), else generated. [A-Za-z0-9_-]{1,128} */
  readonly id?: string;
  /** Abandon the archive once it passes this many bytes (CHECKPOINT_TOO_LARGE). */
  readonly maxBytes?: number;
}

export interface LayerUsageReport {
  /** Bytes the writable layer takes on disk (holes in sparse files excluded). */
  readonly used_bytes: number;
  readonly entries: number;
  /** The sandbox's disk size (storage_gb), 0 without one. */
  readonly limit_bytes: number;
  /** Upper bound on the size of a checkpoint taken now. */
  readonly expected_archive_bytes: number;
}

export interface PruneReport {
  readonly bridges: string[];
  readonly veths: string[];
  readonly mounts: string[];
  /** Loop devices over a sandbox disk image no live sandbox owns. */
  readonly loopDevices: string[];
  readonly directories: string[];
  readonly cgroups: string[];
  readonly processes: number[];
  /** nftables tables removed (this agent's, once no sandbox is left). */
  readonly tables: string[];
  readonly errors: string[];
}

/** What a reassert of the network boundary had to put back: one line per repair. */
export interface NetworkReassertReport {
  readonly repaired: number;
  readonly repairs: string[];
}

/** Where a source sends a native live migration (qemu): minted by the target for one migration. */
export interface MigrationTarget {
  readonly uri: string;
  /** Hex pre-shared key of the TLS session: only its holder can send, or receive, this stream. */
  readonly psk: string;
  readonly expires_at: string;
}

export interface MigrationSendReport {
  readonly downtime_ms: number;
  readonly total_ms: number;
  readonly transferred_bytes: number;
  /** Post-copy: answered at the switch-over, pages still flowing from the source. */
  readonly lazy?: boolean;
}

export interface Backend {
  readonly kind: 'process' | 'qemu';
  /** Metrics, OOM kills, console logs (observe.ts); absent: the observe routes answer 501. */
  readonly observer?: SandboxObserver;
  /** Lazy (post-copy) moves with CRIU (process backend); absent: the lazy routes answer LAZY_PAGES_UNSUPPORTED. */
  readonly lazy?: LazyMemoryApi;
  capacity(): Promise<HostCapacity>;
  create(spec: CreateSpec): Promise<SandboxInfo>;
  get(name: string): Promise<SandboxInfo>;
  list(prefix?: string): Promise<SandboxInfo[]>;
  /** Idempotent: destroying an unknown sandbox resolves. */
  destroy(name: string, opts?: DestroyOptions): Promise<void>;
  spawn(name: string, opts: SpawnOptions): Promise<ProcessHandle>;
  /**
   * A host path for `guestPath` confined to the sandbox root: `..` and
   * symlinks are resolved as the guest would see them, and an escape is
   * PATH_ESCAPES_SANDBOX. forWrite: the parent directory must exist (it is
   * not created); the final component may be absent. Not forWrite: the path
   * must exist (GUEST_PATH_NOT_FOUND). The host path is valid while the
   * sandbox runs.
   */
  resolveGuestPath(name: string, guestPath: string, opts: { forWrite: boolean }): Promise<string>;
  /**
   * Writes a file from inside the sandbox (temp file + rename, in the
   * guest's own view of its filesystem), after the same confinement check as
   * resolveGuestPath. Prefer it to writing through a resolveGuestPath host
   * path: a guest process racing to swap a path component for a symlink
   * cannot redirect a write made from inside its root. Beyond maxBytes:
   * PAYLOAD_TOO_LARGE, and nothing is left behind.
   */
  writeGuestFile(
    name: string,
    guestPath: string,
    data: Readable,
    /** parents: missing directories of the path are made first, as `mkdir -p` by the guest's root. */
    opts?: { mode?: number; maxBytes?: number; parents?: boolean },
  ): Promise<{ path: string; bytes: number }>;
  /**
   * Streams a regular file from inside the sandbox (GUEST_PATH_NOT_A_FILE for
   * anything else). `done` settles when the stream has ended, rejecting if
   * the read failed part-way.
   */
  readGuestFile(name: string, guestPath: string): Promise<{ path: string; size: number; stream: Readable; done: Promise<void> }>;
  checkpoint(name: string, opts: CheckpointOptions): Promise<Checkpoint>;
  /** Memory checkpoint, then the processes stop; state `paused` (MEMORY_CHECKPOINT_UNSUPPORTED without criu). Idempotent. */
  pause(name: string, opts?: { id?: string; comment?: string }): Promise<Checkpoint>;
  /** Resumes a paused sandbox from its pause checkpoint. Idempotent. */
  resume(name: string): Promise<SandboxInfo>;
  /** Back to a checkpoint on this host: live resumes its processes, disk boots afresh over its layer. */
  restoreCheckpoint(name: string, checkpointId: string): Promise<SandboxInfo>;
  /** The writable layer's usage, and the expected size of a checkpoint of it. */
  layerUsage(name: string): Promise<LayerUsageReport>;
  listCheckpoints(): Promise<Checkpoint[]>;
  getCheckpoint(id: string): Promise<Checkpoint>;
  /** Idempotent. */
  deleteCheckpoint(id: string): Promise<void>;
  /** `<dataDir>/checkpoints/<id>`; CHECKPOINT_NOT_FOUND if absent. */
  checkpointDir(id: string): Promise<string>;
  /** Where to stage pulled checkpoints (same filesystem as checkpoints/). */
  stagingDir(): string;
  /** verifyDigest: false skips re-hashing rootfs.tar when the caller verified it while streaming. */
  importCheckpoint(stagingPath: string, opts?: { verifyDigest?: boolean }): Promise<Checkpoint>;
  prune(): Promise<PruneReport>;
  /** Re-applies the sandbox network boundary (firewall tables, per-link sysctls) and reports what had drifted. */
  reassertNetwork(): Promise<NetworkReassertReport>;
  /** Replaces a running sandbox's outbound policy. */
  setEgress(name: string, egress: AgentEgressParsed): Promise<SandboxInfo>;
  /** The resolved outbound policy with a probe of its proxy endpoint. */
  egressStatus(name: string): Promise<EgressStatus>;
  /**
   * Native live migration (qemu; absent: the migration routes answer 409 BACKEND_UNSUPPORTED).
   * offer (source) -> prepareIncoming (target) -> sendMigration (source; it stays stopped, `paused`,
   * until destroyed, or resumed if the target failed) -> completeIncoming (target).
   */
  migrationOffer?(name: string): Promise<Record<string, unknown>>;
  prepareIncoming?(spec: CreateSpec, machine: Record<string, unknown>, opts: { ttlMs: number; lazy?: boolean }): Promise<MigrationTarget>;
  sendMigration?(name: string, to: { uri: string; psk: string }, opts?: { lazy?: boolean }): Promise<MigrationSendReport>;
  completeIncoming?(name: string, opts: { keepPaused: boolean }): Promise<SandboxInfo>;
  /** Gives up a prepared migration that has not completed (its listener, key, QEMU, address); false when none waits. */
  abortIncoming?(name: string): Promise<boolean>;
  /**
   * Where a VM's memory is when the backend pages it in by itself (qemu post-copy), for the memory route where `lazy`
   * (CRIU) is absent.
   */
  memoryStatus?(name: string): Promise<{ resident_chunks: number; total_chunks: number; done: boolean; error?: string }>;
  /** Rediscover sandboxes and recreate their endpoint proxies (called by open()). */
  recover(): Promise<SandboxInfo[]>;
  /** Stops the endpoint proxies; sandboxes keep running. */
  close(): Promise<void>;
}

/** What the agent's lazy routes need of a backend (implemented by process/criu-lazy-sandbox.ts). */
export interface LazyMemoryApi {
  pauseLazy(name: string, opts?: { id?: string; comment?: string }): Promise<Checkpoint>;
  source(checkpointId: string): { readonly port: number; readonly startedAt: number; streaming: boolean } | undefined;
  openPages(checkpointId: string): import('node:net').Socket;
  createLazy(spec: CreateSpec, from: { readonly url: string; readonly grant: string }): Promise<SandboxInfo>;
  memoryStatus(name: string): Promise<{ resident_chunks: number; total_chunks: number; done: boolean; error?: string }>;
}
