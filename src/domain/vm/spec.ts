import { z } from 'zod';
import { archSchema, egressSpecProblems, egressSpecSchema } from '@fleet/agent-protocol';
import { ValidationError, describeFields, fieldsFromZod, validationErrorFrom, type FieldError } from '@fleet/agent-protocol';
import { hostBackendSchema, labelsSchema } from '../host/host.events.js';
import { idSchema } from '../ids.js';
import { metadataSchema } from './vm.lifecycle.js';
import type { PlacementRequest } from '../placement/placement.js';

/** Guest directory the fleet writes its own files into (agent manifest, credentials): callers may not write under it. */
export const RESERVED_GUEST_DIR = '/etc/fleet';

/** Fleet-wide bounds a spec is checked against; built by the command layer from config. */
export interface SpecLimits {
  readonly minCpus: number;
  readonly maxCpus: number;
  readonly minRamMb: number;
  readonly maxRamMb: number;
  readonly minStorageGb: number;
  readonly maxStorageGb: number;
  readonly maxGpus: number;
  /** FleetConfig.MaxStartupScriptTimeout (config MAX_STARTUP_SCRIPT_TIMEOUT_MS). */
  readonly maxStartupScriptTimeoutMs: number;
  /** Decoded bytes over all caller files (spec.files and agent.files together). */
  readonly maxFilesBytes: number;
}

export const DEFAULT_SPEC_LIMITS: SpecLimits = {
  minCpus: 1,
  maxCpus: 64,
  minRamMb: 128,
  maxRamMb: 262_144,
  minStorageGb: 1,
  maxStorageGb: 2_048,
  maxGpus: 8,
  maxStartupScriptTimeoutMs: 50_000,
  maxFilesBytes: 16 * 1024 * 1024,
};

const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/;

/** Absolute, normalised (no `.`/`..`/empty segments, no trailing slash), so the reserved-dir check cannot be walked around. */
export function guestPathProblem(path: string): string | undefined {
  if (!path.startsWith('/')) return 'must be an absolute guest path';
  if (path.length > 4096) return 'longer than 4096 characters';
  if (path.includes('\0')) return 'must not contain NUL';
  if (path === '/') return 'must name a file, not /';
  const segments = path.slice(1).split('/');
  if (segments.some((s) => s === '' || s === '.' || s === '..'))
    return 'must be normalised: no empty, "." or ".." segments and no trailing slash';
  if (path === RESERVED_GUEST_DIR || path.startsWith(`${RESERVED_GUEST_DIR}/`))
    return `is under ${RESERVED_GUEST_DIR}, which is reserved for the fleet's own files`;
  return undefined;
}

export const guestFilesSchema = z.record(z.string(), z.string().regex(BASE64, 'file content must be base64')).superRefine((files, ctx) => {
  for (const path of Object.keys(files)) {
    const problem = guestPathProblem(path);
    if (problem) ctx.addIssue({ code: 'custom', path: [path], message: `${path} ${problem}` });
  }
});

export const protocolSchema = z.enum(['tcp', 'udp']);

export const exposeSchema = z.object({
  port: z.number().int().min(1, 'a port 1–65535').max(65535, 'a port 1–65535'),
  as: z.string().regex(/^[a-z0-9][a-z0-9_-]{0,31}$/, 'a label: lowercase letters, digits, _ and -, up to 32 characters'),
  protocol: protocolSchema.default('tcp'),
  /** Through the ingress without the VM's traffic token; private (token required) by default. */
  public: z.boolean().optional(),
});
export type ExposeSpec = z.infer<typeof exposeSchema>;

export const agentSpecSchema = z.object({
  command: z.string().min(1).max(4096),
  drain_command: z.string().max(4096).optional(),
  files: guestFilesSchema.optional(),
  expose: z.array(exposeSchema).max(32).optional(),
});

export const healthcheckSchema = z
  .object({
    http: z.object({ port: z.number().int().min(1).max(65535), path: z.string().startsWith('/').max(2048).optional() }).optional(),
    exec: z.array(z.string()).min(1).optional(),
    interval_seconds: z.number().int().positive().max(3600).optional(),
    timeout_seconds: z.number().int().positive().max(3600).optional(),
    retries: z.number().int().nonnegative().max(100).optional(),
    start_period_seconds: z.number().int().nonnegative().max(86_400).optional(),
  })
  .refine((h) => (h.http === undefined) !== (h.exec === undefined), { error: 'set exactly one of http or exec' });

/** Secrets are environment variables of the guest: names as a shell takes them, bounded so events stay small. */
export const SECRET_LIMITS = { maxCount: 64, maxValueBytes: 32 * 1024, maxTotalBytes: 128 * 1024 } as const;
const secretNameSchema = z
  .string()
  .regex(
    /^[A-Za-z_][A-Za-z0-9_]{0,127}$/,
    'a secret name is an environment variable name: letters, digits and _, not starting with a digit, up to 128 characters',
  );
// Messages never quote a value: a refused secret must not come back in the 400 or the log.
export const secretsSchema = z.record(secretNameSchema, z.string()).superRefine((secrets, ctx) => {
  const entries = Object.entries(secrets);
  if (entries.length > SECRET_LIMITS.maxCount)
    ctx.addIssue({ code: 'custom', message: `at most ${SECRET_LIMITS.maxCount} secrets (got ${entries.length})` });
  let total = 0;
  for (const [name, value] of entries) {
    const bytes = Buffer.byteLength(value, 'utf8') + Buffer.byteLength(name, 'utf8');
    total += bytes;
    if (Buffer.byteLength(value, 'utf8') > SECRET_LIMITS.maxValueBytes)
      ctx.addIssue({ code: 'custom', path: [name], message: `a secret value is at most ${SECRET_LIMITS.maxValueBytes} bytes` });
    if (value.includes('\0'))
      ctx.addIssue({ code: 'custom', path: [name], message: 'a secret value must not contain NUL (it becomes an environment variable)' });
  }
  if (total > SECRET_LIMITS.maxTotalBytes)
    ctx.addIssue({ code: 'custom', message: `secrets total ${total} bytes, above the limit of ${SECRET_LIMITS.maxTotalBytes}` });
});

/**
 * A VM spec as the API takes it (snake_case). Structural and cross-field
 * rules live here so a route validating its body with this schema already
 * refuses them; the fleet's numeric limits are applied by `validateVmSpec`.
 */
const vmSpecObject = z.object({
  name: z
    .string()
    .regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$/, 'a name: letters, digits and ._-, up to 63 characters')
    .optional(),
  cpus: z.number().int().default(1),
  ram_mb: z.number().int().default(512),
  storage_gb: z.number().int().default(1),
  region: z.string().max(64).optional(),
  arch: archSchema.optional(),
  gpus: z.number().int().nonnegative().default(0),
  gpu_kind: z.string().min(1).max(64).optional(),
  gpu_profile: z.string().min(1).max(64).optional(),
  host_id: idSchema.optional(),
  labels: labelsSchema.optional(),
  max_runtime_s: z.number().int().nonnegative().optional(),
  idle_timeout_s: z.number().int().nonnegative().optional(),
  /** What an idle timeout does: destroy (default), or pause (memory checkpoint; placed only on hosts that can take one). */
  on_idle: z.enum(['pause', 'destroy']).optional(),
  image: z.string().min(1).max(256).optional(),
  seed_snapshot_id: idSchema.optional(),
  pinned_host_id: idSchema.optional(),
  backend: hostBackendSchema.optional(),
  startup_script: z
    .string()
    .max(256 * 1024, 'at most 256 KiB; upload larger scripts as files')
    .optional(),
  startup_script_timeout_s: z.number().positive().optional(),
  files: guestFilesSchema.optional(),
  agent: agentSpecSchema.optional(),
  expose: z.array(exposeSchema).max(32).optional(),
  healthcheck: healthcheckSchema.optional(),
  net_raw: z.boolean().optional(),
  secrets: secretsSchema.optional(),
  /** Caller metadata: kept on VmRequested and the VM, not in the stored spec (PATCH replaces it). */
  metadata: metadataSchema.optional(),
  /** Outbound policy; absent: direct (the seed's zero value). */
  egress: egressSpecSchema.optional(),
  /** A tenant network to join (POST /v1/networks): its members reach each other and nothing else. */
  network_id: idSchema.optional(),
  /** The member address wanted on that network: taken when free, else the lowest free one (seed `Reserve`). */
  ip_hint: z.ipv4().optional(),
});

export const vmSpecSchema = vmSpecObject.strict().superRefine((s, ctx) => {
  if (s.image !== undefined && s.seed_snapshot_id !== undefined) {
    ctx.addIssue({ code: 'custom', path: ['seed_snapshot_id'], message: 'image and seed_snapshot_id are mutually exclusive: set one' });
  }
  if (s.gpus === 0 && s.gpu_kind !== undefined) ctx.addIssue({ code: 'custom', path: ['gpu_kind'], message: 'gpu_kind needs gpus > 0' });
  if (s.gpus === 0 && s.gpu_profile !== undefined)
    ctx.addIssue({ code: 'custom', path: ['gpu_profile'], message: 'gpu_profile needs gpus > 0' });
  if (s.startup_script_timeout_s !== undefined && s.startup_script === undefined) {
    ctx.addIssue({ code: 'custom', path: ['startup_script_timeout_s'], message: 'startup_script_timeout_s needs a startup_script' });
  }
  if (s.ip_hint !== undefined && s.network_id === undefined)
    ctx.addIssue({ code: 'custom', path: ['ip_hint'], message: 'ip_hint needs a network_id' });
  if (s.network_id !== undefined && s.backend === 'firecracker')
    ctx.addIssue({
      code: 'custom',
      path: ['network_id'],
      message: 'cluster networks are built for process and qemu hosts only, not firecracker',
    });
  const seen = new Set<string>();
  const all = [
    ...(s.expose ?? []).map((e, i) => ({ e, path: ['expose', i, 'as'] })),
    ...(s.agent?.expose ?? []).map((e, i) => ({ e, path: ['agent', 'expose', i, 'as'] })),
  ];
  for (const { e, path } of all) {
    if (seen.has(e.as)) ctx.addIssue({ code: 'custom', path, message: `expose label "${e.as}" is used twice; labels must be unique` });
    seen.add(e.as);
  }
});
export type VmSpecInput = z.input<typeof vmSpecSchema>;
export type VmSpec = z.output<typeof vmSpecSchema>;

/**
 * The spec as events keep it: caller file contents are dropped (only their
 * paths stay): they can be megabytes and are only needed during the create
 * request that uploads them. What may hold credentials and is needed again
 * later (the startup script, the in-guest agent's command and drain command,
 * the secrets) is
 * kept only as AES-256-GCM ciphertext (`*_encrypted`), sealed by the command
 * layer. `startup_script` and `agent.command` in clear are read from events
 * written before sealing existed; nothing writes them any more.
 */
export const storedVmSpecSchema = vmSpecObject.omit({ files: true, agent: true, secrets: true, metadata: true }).extend({
  file_paths: z.array(z.string()).optional(),
  startup_script_encrypted: z.string().optional(),
  secrets_encrypted: z.string().optional(),
  agent: agentSpecSchema
    .omit({ files: true, command: true })
    .extend({
      command: z.string().optional(),
      command_encrypted: z.string().optional(),
      drain_command_encrypted: z.string().optional(),
      file_paths: z.array(z.string()).optional(),
    })
    .optional(),
});
export type StoredVmSpec = z.output<typeof storedVmSpecSchema>;

/** Ciphertexts of the spec's sealed fields, made by the command layer (sealing needs a key and randomness). */
export interface SealedSpecFields {
  readonly startup_script?: string | undefined;
  readonly agent_command?: string | undefined;
  readonly agent_drain_command?: string | undefined;
  readonly secrets?: string | undefined;
}

/** AES-GCM associated data per sealed field: a ciphertext copied onto another VM or field does not open. */
export type SealedField = 'startup_script' | 'agent.command' | 'agent.drain_command' | 'secrets';
export const sealedFieldContext = (vmId: string, field: SealedField): string => `vm:${vmId}:${field}`;

export function toStoredSpec(spec: VmSpec, sealed: SealedSpecFields = {}): StoredVmSpec {
  const { files, agent, secrets, startup_script, metadata: _metadata, ...rest } = spec;
  const stored: StoredVmSpec = { ...rest };
  if (files) stored.file_paths = Object.keys(files).sort();
  // Refusing here, not storing in clear, is what keeps a forgotten seal out of the event store.
  if (startup_script !== undefined) stored.startup_script_encrypted = required(sealed.startup_script, 'startup_script');
  if (secrets !== undefined && Object.keys(secrets).length > 0) stored.secrets_encrypted = required(sealed.secrets, 'secrets');
  if (agent) {
    const { files: agentFiles, command: _command, drain_command, ...agentRest } = agent;
    stored.agent = { ...agentRest, command_encrypted: required(sealed.agent_command, 'agent.command') };
    if (drain_command !== undefined && drain_command !== '')
      stored.agent.drain_command_encrypted = required(sealed.agent_drain_command, 'agent.drain_command');
    if (agentFiles) stored.agent.file_paths = Object.keys(agentFiles).sort();
  }
  return stored;
}

function required(ciphertext: string | undefined, field: string): string {
  if (ciphertext === undefined) throw new Error(`${field} must be sealed before it is stored`);
  return ciphertext;
}

export const SEALED = '[sealed]';

/**
 * The spec as reads show it (GET, list, as_of, the vms read model): no
 * ciphertext and no clear credential, old events included; a sealed field
 * shows that it is set, never what it is.
 */
export function publicSpec(spec: StoredVmSpec): Record<string, unknown> {
  const { startup_script, startup_script_encrypted, secrets_encrypted: _s, agent, ...rest } = spec;
  const out: Record<string, unknown> = { ...rest };
  if (startup_script !== undefined || startup_script_encrypted !== undefined) out.startup_script = SEALED;
  if (agent) {
    const { command, command_encrypted, drain_command, drain_command_encrypted, ...agentRest } = agent;
    out.agent = {
      ...agentRest,
      ...(command !== undefined || command_encrypted !== undefined ? { command: SEALED } : {}),
      // An empty drain command (nothing to run) reads as it is; one that runs something reads sealed.
      ...(drain_command || drain_command_encrypted !== undefined
        ? { drain_command: SEALED }
        : drain_command !== undefined
          ? { drain_command }
          : {}),
    };
  }
  return out;
}

/** `expose[0].as`, `files["/etc/x"]`: the path of a zod issue as a client would name the field. */
export function formatIssuePath(path: ReadonlyArray<PropertyKey>): string {
  let out = '';
  for (const p of path) {
    if (typeof p === 'number') out += `[${p}]`;
    else if (typeof p === 'string' && /^[A-Za-z_][A-Za-z0-9_]*$/.test(p)) out += out ? `.${p}` : p;
    else out += `[${JSON.stringify(String(p))}]`;
  }
  return out || '(body)';
}

/** Turns zod issues into one ValidationError listing every bad field. */
export function validationErrorFromZod(error: z.ZodError, what = 'request', code = 'VALIDATION_FAILED'): ValidationError {
  return validationErrorFrom(error, what, { code, formatPath: formatIssuePath });
}

export const STARTUP_SCRIPT_TIMEOUT_TOO_LARGE = 'STARTUP_SCRIPT_TIMEOUT_TOO_LARGE';

/**
 * Parses and checks a spec against the fleet's limits. Every problem is
 * listed; the code is STARTUP_SCRIPT_TIMEOUT_TOO_LARGE when that is among
 * them (the seed's ErrStartupScriptTimeoutTooLarge), else VALIDATION_FAILED.
 */
export function validateVmSpec(input: unknown, limits: SpecLimits = DEFAULT_SPEC_LIMITS): VmSpec {
  const spec = parseVmSpec(input);
  checkVmSpec(spec, limits);
  return spec;
}

/** The spec's shape (vmSpecSchema), for a spec built in code rather than parsed at an HTTP edge (E2B's create, a fork). */
export function parseVmSpec(input: unknown): VmSpec {
  const parsed = vmSpecSchema.safeParse(input);
  if (!parsed.success) {
    const fields = fieldsFromZod(parsed.error, formatIssuePath);
    throw new ValidationError(`invalid vm spec: ${describeFields(fields)}`, fields, 'VALIDATION_FAILED');
  }
  return parsed.data;
}

/**
 * What a parsed spec must also meet: the fleet's limits (they are
 * configuration, so the command applies them) and the egress rules.
 */
export function checkVmSpec(s: VmSpec, limits: SpecLimits = DEFAULT_SPEC_LIMITS): void {
  const fields: FieldError[] = [];
  let timeoutTooLarge = false;
  let egressCode: string | undefined;
  for (const p of s.egress ? egressSpecProblems(s.egress) : []) {
    fields.push({ path: p.path, message: p.message });
    if (p.code !== 'VALIDATION_FAILED') egressCode = p.code;
  }
  const range = (path: string, v: number, min: number, max: number, unit: string): void => {
    if (v < min || v > max) fields.push({ path, message: `must be between ${min} and ${max}${unit} (got ${v})` });
  };
  range('cpus', s.cpus, limits.minCpus, limits.maxCpus, '');
  range('ram_mb', s.ram_mb, limits.minRamMb, limits.maxRamMb, ' MB');
  range('storage_gb', s.storage_gb, limits.minStorageGb, limits.maxStorageGb, ' GB');
  if (s.gpus > limits.maxGpus) fields.push({ path: 'gpus', message: `at most ${limits.maxGpus} (got ${s.gpus})` });
  if (s.startup_script_timeout_s !== undefined && s.startup_script_timeout_s * 1000 > limits.maxStartupScriptTimeoutMs) {
    timeoutTooLarge = true;
    fields.push({
      path: 'startup_script_timeout_s',
      message: `startup script timeout ${s.startup_script_timeout_s}s is above the fleet maximum of ${limits.maxStartupScriptTimeoutMs / 1000}s`,
    });
  }
  let bytes = 0;
  for (const content of [...Object.values(s.files ?? {}), ...Object.values(s.agent?.files ?? {})]) bytes += base64Bytes(content);
  if (bytes > limits.maxFilesBytes)
    fields.push({ path: 'files', message: `files total ${bytes} bytes, above the limit of ${limits.maxFilesBytes}` });
  if (fields.length > 0) {
    throw new ValidationError(
      `invalid vm spec: ${describeFields(fields)}`,
      fields,
      timeoutTooLarge ? STARTUP_SCRIPT_TIMEOUT_TOO_LARGE : (egressCode ?? 'VALIDATION_FAILED'),
    );
  }
}

function base64Bytes(b64: string): number {
  const pad = b64.endsWith('==') ? 2 : b64.endsWith('=') ? 1 : 0;
  return (b64.length / 4) * 3 - pad;
}

/** The placement-relevant view of a spec (see placement.ts). */
export function placementRequestOf(spec: VmSpec | StoredVmSpec): PlacementRequest {
  return {
    cpus: spec.cpus,
    ram_mb: spec.ram_mb,
    storage_gb: spec.storage_gb,
    gpus: spec.gpus,
    gpu_kind: spec.gpu_kind,
    gpu_profile: spec.gpu_profile,
    arch: spec.arch,
    backend: spec.backend,
    region: spec.region,
    labels: spec.labels,
    host_id: spec.host_id,
    pinned_host_id: spec.pinned_host_id,
  };
}
