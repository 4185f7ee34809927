import { z } from 'zod';
import { initExitSchema, oomReportSchema } from './observe-protocol.js';
import { hostCapacitySchema } from './capacity.js';
import { agentEgressSchema, egressStatusSchema } from './egress.js';

/**
 * The host-agent wire protocol (`/v1`), shared by the agent (packages/agent) and
 * the control plane's client (src/adapters/host-agent.client.ts). snake_case
 * on the wire, like the seed's JSON tags. Both sides parse with these
 * schemas, so a field renamed on one side fails loudly on the other.
 */

export const AGENT_API_PREFIX = '/v1';

// Names become directory names, cgroup names and interface-name suffixes on
// the host: a conservative alphabet keeps all three safe.
export const vmNameSchema = z
  .string()
  .regex(/^[a-z0-9][a-z0-9-]{0,62}$/, 'a name of 1-63 lowercase letters, digits or dashes, starting with a letter or digit');
export const checkpointIdSchema = z
  .string()
  .regex(/^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$/, 'an id of 1-128 letters, digits, dashes or underscores');
export const imageNameSchema = z
  .string()
  .regex(/^[a-z0-9][a-z0-9._-]{0,62}$/, 'an image name of lowercase letters, digits, dots, dashes or underscores');
export const sha256HexSchema = z.string().regex(/^[0-9a-f]{64}$/, 'a lowercase hex sha256');
/** A file name inside an artifact: one path segment, never `..`. */
export const artifactFileNameSchema = z
  .string()
  .regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/, 'a plain file name (no slashes)')
  .refine((n) => n !== '..' && !n.includes('..'), 'a plain file name (no "..")');
export const tenantIdSchema = z.string().regex(/^[a-z0-9][a-z0-9_-]{0,62}$/, 'a lowercase tenant id');

export const errorBodySchema = z.object({
  code: z.string(),
  message: z.string(),
  details: z.record(z.string(), z.unknown()).optional(),
});
export type ErrorBody = z.infer<typeof errorBodySchema>;

/**
 * Codes the agent answers with (the backend's codes in packages/agent/src/backend.ts
 * pass through unchanged), beyond the generic ones in packages/agent-protocol/src/errors.ts.
 */
export const AgentErrorCode = {
  validation: 'VALIDATION_FAILED',
  unauthorized: 'UNAUTHORIZED',
  notFound: 'NOT_FOUND',
  payloadTooLarge: 'PAYLOAD_TOO_LARGE',
  unsupportedMediaType: 'UNSUPPORTED_MEDIA_TYPE',
  sandboxNotFound: 'SANDBOX_NOT_FOUND',
  sandboxExists: 'SANDBOX_EXISTS',
  sandboxNotRunning: 'SANDBOX_NOT_RUNNING',
  invalidSpec: 'INVALID_SANDBOX_SPEC',
  imageNotFound: 'IMAGE_NOT_FOUND',
  guestPathNotFound: 'GUEST_PATH_NOT_FOUND',
  pathEscapesSandbox: 'PATH_ESCAPES_SANDBOX',
  notAFile: 'GUEST_PATH_NOT_A_FILE',
  checkpointNotFound: 'CHECKPOINT_NOT_FOUND',
  checkpointExists: 'CHECKPOINT_EXISTS',
  checkpointCorrupt: 'CHECKPOINT_CORRUPT',
  checkpointTooLarge: 'CHECKPOINT_TOO_LARGE',
  exposeNotPublished: 'EXPOSE_NOT_PUBLISHED',
  exposePortUnavailable: 'EXPOSE_PORT_UNAVAILABLE',
  /** The one "this host refuses for capacity" code (status 507). */
  capacityExhausted: 'HOST_CAPACITY_EXHAUSTED',
  grantInvalid: 'GRANT_INVALID',
  grantExpired: 'GRANT_EXPIRED',
  artifactDigestMismatch: 'ARTIFACT_DIGEST_MISMATCH',
  artifactTransferFailed: 'ARTIFACT_TRANSFER_FAILED',
  featureMissing: 'HOST_FEATURE_MISSING',
  sandboxFailed: 'SANDBOX_FAILED',
  agentError: 'AGENT_ERROR',
  hostUnreachable: 'HOST_UNREACHABLE',
} as const;

export const protocolSchema = z.enum(['tcp', 'udp']);

export const exposeSpecSchema = z.object({
  port: z.number().int().min(1).max(65535),
  as: z.string().min(1).max(63),
  protocol: protocolSchema.default('tcp'),
});
export type ExposeSpec = z.infer<typeof exposeSpecSchema>;

export const endpointSchema = z.object({
  as: z.string(),
  url: z.string(),
  port: z.number().int(),
  /** What the agent actually published on, not what was asked. */
  protocol: protocolSchema,
});
export type Endpoint = z.infer<typeof endpointSchema>;

// ---- capacity -------------------------------------------------------------

export const capacityResponseSchema = hostCapacitySchema.extend({
  backend: z.string(),
  /** VM backends: the accelerator guests run on (kvm, or tcg when KVM is absent or does not work). */
  accel: z.enum(['kvm', 'tcg']).optional(),
  /** backend.go.txt NestedVirtSupported: guests can run VMs of their own. */
  nested_virt_supported: z.boolean().optional(),
  /** Sandboxes currently known to the agent. */
  vms_running: z.number().int().nonnegative(),
});
export type CapacityResponse = z.infer<typeof capacityResponseSchema>;

// ---- VMs -------------------------------------------------------------------

export const vmStateSchema = z.enum(['running', 'stopped', 'paused']);
export type VmState = z.infer<typeof vmStateSchema>;

export const createFileSchema = z.object({
  path: z.string().startsWith('/', 'path must be absolute inside the sandbox').max(4096),
  content_b64: z.base64(),
  /** Octal, e.g. "600"; default 644. */
  mode: z
    .string()
    .regex(/^[0-7]{3,4}$/, 'an octal mode such as 644 or 0755')
    .optional(),
});

export type CreateFile = z.input<typeof createFileSchema>;

/** A device or MIG instance uuid as capacity reported it: opaque to the protocol, never a path. */
const gpuBindingUuidSchema = z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$/, 'a device uuid as the host reported it');

export const createVmRequestSchema = z
  .object({
    name: vmNameSchema,
    /** Base image; empty means the agent's default. Exclusive with checkpoint_id. */
    image: imageNameSchema.optional(),
    /** Boot from a checkpoint in this host's store instead of an image. */
    checkpoint_id: checkpointIdSchema.optional(),
    cpus: z.number().int().min(1).max(1024).default(1),
    ram_mb: z
      .number()
      .int()
      .min(16)
      .max(4 * 1024 * 1024)
      .default(512),
    storage_gb: z.number().int().min(0).max(65536).default(0),
    /** Network isolation scope: sandboxes of different tenants never share a bridge unless the operator allows it. */
    tenant: tenantIdSchema.default('default'),
    env: z.record(z.string(), z.string()).default({}),
    /** Guest ports to publish as host-reachable endpoints (tcp or udp). */
    expose: z.array(exposeSpecSchema).max(64).default([]),
    /** Honoured if free in the subnet, else the lowest free address. */
    ip_hint: z.ipv4().optional(),
    /** A cluster network to join (members reach each other, nothing else); its subnet lies inside the agent's. */
    network: z.object({ id: z.string().regex(/^[a-z0-9][a-z0-9-]{0,62}$/), subnet: z.cidrv4() }).optional(),
    /** Keep CAP_NET_RAW in the sandbox (raw sockets: ping, packet capture); dropped by default. */
    net_raw: z.boolean().optional(),
    /** Outbound policy; absent: none, as before egress existed (the control plane always sends one; its API defaults to direct). */
    egress: agentEgressSchema.optional(),
    /** Resume the processes of checkpoint_id (a live checkpoint) instead of booting its rootfs: a fork or a move. */
    resume: z.boolean().optional(),
    /**
     * Written into the sandbox (parent directories made) before the create answers, so a create with
     * its guest files is one call; a file that cannot be written fails the create and removes the sandbox.
     * The answer's `files_written` says they were (an agent without this field answers without it).
     */
    files: z.array(createFileSchema).max(1024).optional(),
    /**
     * Whole GPUs the control plane's reservation bound to this VM, by the uuids the host's capacity
     * reported (`gpu_devices[].uuid`); passed through to the VM (qemu only: any other backend refuses).
     */
    gpu_uuids: z.array(gpuBindingUuidSchema).max(16).optional(),
    /** MIG instances the reservation bound, by `mig_instances[].uuid` (qemu only, as mediated devices). */
    mig_instance_uuids: z.array(gpuBindingUuidSchema).max(16).optional(),
  })
  .refine((r) => !(r.image && r.checkpoint_id), { error: 'give image or checkpoint_id, not both', path: ['checkpoint_id'] });
export type CreateVmRequest = z.input<typeof createVmRequestSchema>;

export const vmInfoSchema = z.object({
  name: z.string(),
  state: vmStateSchema,
  image: z.string(),
  tenant: z.string(),
  ip: z.string().optional(),
  mac: z.string().optional(),
  cpus: z.number().int(),
  ram_mb: z.number().int(),
  created_at: z.string(),
  from_checkpoint: z.string().optional(),
  endpoints: z.array(endpointSchema).default([]),
  /** OOM kills in the sandbox (observability); absent from an agent without the monitor. */
  oom: oomReportSchema.optional(),
  /** A stopped sandbox: how its init ended, when the host recorded it. */
  init_exit: initExitSchema.optional(),
  /** Absent from agents that predate egress (their sandboxes have no outbound network). */
  egress: egressStatusSchema.optional(),
  /** A create's answer: how many of its `files` were written (absent from agents without create files). */
  files_written: z.number().int().nonnegative().optional(),
});
export type VmInfo = z.infer<typeof vmInfoSchema>;

export const listVmsQuerySchema = z.object({ prefix: z.string().max(63).default('') });
export const listVmsResponseSchema = z.object({ vms: z.array(vmInfoSchema) });

export const destroyVmQuerySchema = z.object({
  /** Skip the drain command and stop at once. */
  force: z
    .enum(['true', 'false', '1', '0'])
    .default('false')
    .transform((v) => v === 'true' || v === '1'),
});
export const destroyVmResponseSchema = z.object({ name: z.string(), destroyed: z.boolean(), drained: z.boolean() });
export type DestroyVmResponse = z.infer<typeof destroyVmResponseSchema>;

/** `GET /v1/vms/:name/console`: the tail of the sandbox's serial-style init log, as text. */
export const consoleQuerySchema = z.object({
  tail_bytes: z.coerce
    .number()
    .int()
    .min(1)
    .max(16 * 1024 * 1024)
    .default(64 * 1024),
});

// ---- exec ------------------------------------------------------------------

export const outputEncodingSchema = z.enum(['utf8', 'base64']);

export const execRequestSchema = z.object({
  argv: z.array(z.string()).min(1, 'argv needs at least the program to run'),
  env: z.record(z.string(), z.string()).default({}),
  cwd: z.string().startsWith('/', 'cwd must be an absolute path inside the sandbox').optional(),
  /** 0 or absent: the agent's default. Above the agent's maximum: clamped. */
  timeout_ms: z.number().int().nonnegative().optional(),
  /** Bytes fed to the command's stdin, base64. */
  stdin: z.base64().optional(),
  encoding: outputEncodingSchema.default('utf8'),
});
export type ExecRequest = z.input<typeof execRequestSchema>;

export const execResultSchema = z.object({
  /** A non-zero exit is a result, not an error. -1 when killed by a signal. */
  exit_code: z.number().int(),
  signal: z.string().optional(),
  stdout: z.string(),
  stderr: z.string(),
  encoding: outputEncodingSchema,
  stdout_truncated: z.boolean(),
  stderr_truncated: z.boolean(),
  timed_out: z.boolean(),
  duration_ms: z.number().nonnegative(),
  /** The command died of an OOM kill (SIGKILL while the sandbox's oom_kill counter rose), not a bare exit 137. */
  oom_killed: z.boolean().optional(),
});
export type ExecResult = z.infer<typeof execResultSchema>;

// ---- streaming exec and attach (websocket, JSON text frames) ---------------

/** First frame on `GET /v1/vms/:name/exec` (websocket). */
export const execStreamStartSchema = z.object({
  type: z.literal('start'),
  argv: z.array(z.string()).min(1),
  env: z.record(z.string(), z.string()).default({}),
  cwd: z.string().startsWith('/').optional(),
  timeout_ms: z.number().int().nonnegative().optional(),
});
export type ExecStreamStart = z.input<typeof execStreamStartSchema>;

/** First frame on `GET /v1/vms/:name/attach` (websocket): the seed's AttachSpec. Empty cmd: the login shell. */
export const attachStartSchema = z.object({
  type: z.literal('start'),
  cmd: z.array(z.string()).default([]),
  tty: z.boolean().default(false),
  rows: z.number().int().min(1).max(65535).default(24),
  cols: z.number().int().min(1).max(65535).default(80),
  env: z.record(z.string(), z.string()).default({}),
});
export type AttachStart = z.input<typeof attachStartSchema>;

/** Frames a client sends after the start frame. `data` is base64. */
export const clientFrameSchema = z.discriminatedUnion('type', [
  z.object({ type: z.literal('stdin'), data: z.base64() }),
  /** Closes the process's stdin. */
  z.object({ type: z.literal('eof') }),
  z.object({ type: z.literal('resize'), rows: z.number().int().min(1).max(65535), cols: z.number().int().min(1).max(65535) }),
  z.object({ type: z.literal('signal'), signal: z.enum(['SIGINT', 'SIGTERM', 'SIGKILL', 'SIGHUP', 'SIGQUIT']) }),
]);
export type ClientFrame = z.infer<typeof clientFrameSchema>;

/** Frames the agent sends. `exit` is the last one; `error` is sent instead when the process never started. */
export const serverFrameSchema = z.discriminatedUnion('type', [
  z.object({ type: z.literal('started'), pid: z.number().int().optional() }),
  z.object({ type: z.literal('stdout'), data: z.string() }),
  z.object({ type: z.literal('stderr'), data: z.string() }),
  z.object({
    type: z.literal('exit'),
    code: z.number().int(),
    signal: z.string().optional(),
    timed_out: z.boolean().default(false),
    oom_killed: z.boolean().optional(),
  }),
  z.object({ type: z.literal('error'), code: z.string(), message: z.string() }),
]);
export type ServerFrame = z.infer<typeof serverFrameSchema>;

// ---- files -----------------------------------------------------------------

export const filePathQuerySchema = z.object({
  path: z.string().startsWith('/', 'path must be absolute inside the sandbox').max(4096),
  /** Octal file mode for an upload, e.g. "755". */
  mode: z
    .string()
    .regex(/^[0-7]{3,4}$/, 'an octal mode such as 644 or 0755')
    .optional(),
});
export const uploadResponseSchema = z.object({ path: z.string(), size_bytes: z.number().int().nonnegative() });
export type UploadResponse = z.infer<typeof uploadResponseSchema>;

// ---- in-guest agent ----------------------------------------------------------

export const agentSpecSchema = z.object({
  /** Guest path -> base64 content, written before the command starts. */
  files: z.record(z.string().startsWith('/', 'file paths must be absolute'), z.base64()).default({}),
  /** Shell command that launches the daemon (run detached, `sh -c`). */
  command: z.string().min(1),
  /** Run inside the guest on graceful destroy; empty skips. */
  drain_command: z.string().default(''),
  expose: z.array(exposeSpecSchema).default([]),
  env: z.record(z.string(), z.string()).default({}),
});
export type AgentSpec = z.input<typeof agentSpecSchema>;
export const startAgentResponseSchema = z.object({
  started: z.boolean(),
  pid: z.number().int().optional(),
  endpoints: z.array(endpointSchema),
});
export type StartAgentResponse = z.infer<typeof startAgentResponseSchema>;

// ---- checkpoints -------------------------------------------------------------

export const snapshotKindSchema = z.enum(['disk', 'live']);
export type SnapshotKind = z.infer<typeof snapshotKindSchema>;

export const createCheckpointRequestSchema = z.object({
  comment: z.string().max(1024).default(''),
  /** Ask for memory too. A backend that cannot answers with a disk checkpoint and says kind: disk. */
  live: z.boolean().default(false),
  /** Caller-chosen id (the control plane's snapshot id); absent: the agent generates one. */
  id: checkpointIdSchema.optional(),
  /** The archive is abandoned past this many bytes (CHECKPOINT_TOO_LARGE, 413): the tenant's quota headroom. */
  max_bytes: z.number().int().positive().optional(),
});
export type CreateCheckpointRequest = z.input<typeof createCheckpointRequestSchema>;

export const checkpointSchema = z.object({
  id: z.string(),
  vm_name: z.string().optional(),
  comment: z.string(),
  size_bytes: z.number().int().nonnegative(),
  created_at: z.string(),
  /** sha256 of the rootfs artifact, computed while it was written. */
  digest: z.string(),
  /** What the checkpoint actually contains, not what was asked. */
  kind: snapshotKindSchema,
  image: z.string(),
  /** Memory half of a live checkpoint: file name -> sha256. Empty for disk. */
  files: z.record(z.string(), z.string()).default({}),
  parent: z.string().optional(),
  /** How long the guest was frozen for it (live checkpoints and pauses), when the agent measured it. */
  pause_ms: z.number().int().nonnegative().optional(),
});
export type Checkpoint = z.infer<typeof checkpointSchema>;
export const listCheckpointsResponseSchema = z.object({ checkpoints: z.array(checkpointSchema) });

/** The writable layer's usage, asked before a checkpoint so the quota is checked before anything is archived. */
export const layerUsageResponseSchema = z.object({
  used_bytes: z.number().int().nonnegative(),
  entries: z.number().int().nonnegative(),
  /** storage_gb in bytes; 0: the sandbox has no disk of its own. */
  limit_bytes: z.number().int().nonnegative(),
  /** Upper bound on the size of a checkpoint taken now (barring writes in between). */
  expected_archive_bytes: z.number().int().nonnegative(),
});
export type LayerUsageResponse = z.infer<typeof layerUsageResponseSchema>;

export const deleteCheckpointResponseSchema = z.object({ id: z.string(), deleted: z.boolean() });

// ---- artifacts ---------------------------------------------------------------

export const createGrantRequestSchema = z.object({
  snapshot_id: checkpointIdSchema,
  ttl_s: z.number().int().min(1).max(3600).default(300),
});
export type CreateGrantRequest = z.input<typeof createGrantRequestSchema>;
export const grantResponseSchema = z.object({ snapshot_id: z.string(), grant: z.string(), expires_at: z.string() });
export type GrantResponse = z.infer<typeof grantResponseSchema>;

export const artifactFileSchema = z.object({
  name: artifactFileNameSchema,
  size_bytes: z.number().int().nonnegative(),
  sha256: sha256HexSchema,
  /**
   * The file cut into content-defined chunks (boundaries where a rolling hash of the bytes says so, so an
   * insertion shifts only the chunks around it), in order; only when asked for with ?chunks=1. A puller with an
   * older copy fetches only the chunks it cannot find in it.
   */
  chunks: z.array(z.object({ size: z.number().int().positive(), sha256: sha256HexSchema })).optional(),
});
export const artifactManifestQuerySchema = z.object({ chunks: z.literal('1').optional() });
export type ArtifactFile = z.infer<typeof artifactFileSchema>;

/** What a peer serves under a grant: every file of the checkpoint with its size and sha256. */
export const artifactManifestSchema = z.object({
  snapshot_id: z.string(),
  digest: z.string(),
  kind: snapshotKindSchema,
  /** The file whose sha256 is `digest` (the rootfs archive). */
  rootfs_file: artifactFileNameSchema,
  files: z.array(artifactFileSchema).min(1),
  /** The checkpoint's metadata, replayed by the receiver (image, comment, created_at…). */
  checkpoint: checkpointSchema,
});
export type ArtifactManifest = z.infer<typeof artifactManifestSchema>;

/** The seed's ArtifactEndpoint, as the receiver sees it: where to pull from and under which grant. */
export const artifactEndpointSchema = z.object({
  url: z.url().regex(/^https?:\/\//, "the peer agent's http(s) base URL"),
  grant: z.string().min(1),
  host_id: z.string().optional(),
});

export const artifactMoveSchema = z.object({
  snapshot_id: checkpointIdSchema,
  /** The id on the source; defaults to snapshot_id. */
  source_snapshot_id: checkpointIdSchema.optional(),
  /** Expected sha256 of the rootfs artifact; the pull fails unless the bytes match. */
  digest: sha256HexSchema,
  from: artifactEndpointSchema,
  /** Memory half of a live snapshot: name -> sha256, verified alongside the rootfs. */
  files: z.record(artifactFileNameSchema, sha256HexSchema).default({}),
  /**
   * A checkpoint already on the pulling host (a standby copy of the same VM): a wanted file whose sha256 equals
   * one of its files is copied from it, and of one with the same name only the chunks it lacks are fetched
   * (byte ranges; the manifest's `chunks`). A base that is absent moves everything.
   */
  base_snapshot_id: checkpointIdSchema.optional(),
});
export type ArtifactMove = z.input<typeof artifactMoveSchema>;

export const artifactMovedSchema = z.object({
  snapshot_id: z.string(),
  /** Bytes fetched from the peer: the whole checkpoint, less what a base_snapshot_id copy supplied. */
  size_bytes: z.number().int().nonnegative(),
  /** What the receiving host committed. */
  kind: snapshotKindSchema,
  /** Bytes taken from base_snapshot_id's copy on the receiving host rather than fetched (0 without a base). */
  reused_bytes: z.number().int().nonnegative().optional(),
});
export type ArtifactMoved = z.infer<typeof artifactMovedSchema>;

// ---- prune -------------------------------------------------------------------

export const pruneResponseSchema = z.object({
  /** One line per reclaimed resource, e.g. "mount /…/merged", "cgroup fleet/x", "dir sandboxes/x". */
  reclaimed: z.array(z.string()),
  errors: z.array(z.string()).default([]),
});
export type PruneResponse = z.infer<typeof pruneResponseSchema>;

// ---- network -----------------------------------------------------------------

export const networkReassertResponseSchema = z.object({
  /** How many things the agent had to put back: a missing or edited nftables table, a flipped sysctl. */
  repaired: z.number().int().nonnegative(),
  /** One line per repair, e.g. "nftables table inet fleet_fb missing". */
  repairs: z.array(z.string()),
});
export type NetworkReassertResponse = z.infer<typeof networkReassertResponseSchema>;

export const healthResponseSchema = z.object({ ok: z.boolean(), version: z.string() });

// ---- memory checkpoints (CRIU) -----------------------------------------------------

/** `POST /v1/vms/:name/pause`: a memory checkpoint, then the sandbox's processes stop (its disk stays). */
export const pauseVmRequestSchema = z.object({
  /** Caller-chosen checkpoint id (the control plane's), else generated. */
  id: checkpointIdSchema.optional(),
  comment: z.string().max(1024).default('pause'),
});
export type PauseVmRequest = z.input<typeof pauseVmRequestSchema>;

/** `POST /v1/vms/:name/restore`: back to a checkpoint on this host (live: processes resume; disk: a cold boot). */
export const restoreVmRequestSchema = z.object({ checkpoint_id: checkpointIdSchema });
export type RestoreVmRequest = z.input<typeof restoreVmRequestSchema>;
export const pauseVmResponseSchema = z.object({ vm: vmInfoSchema, checkpoint: checkpointSchema });
