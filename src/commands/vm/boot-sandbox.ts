import {
  ConflictError,
  type AgentEgress,
  type CreateFile,
  type CreateVmRequest,
  type EgressSpec,
  type VmInfo,
} from '@fleet/agent-protocol';
import type { HostAgent } from '../../domain/host-agent.port.js';
import type { StoredVmSpec } from '../../domain/vm/spec.js';
import type { Endpoint, VmReservation } from '../../domain/vm/vm.events.js';

/** Sandboxes the fleet owns carry this prefix on their host, so the reconciler can tell ours from anything else. */
export const SANDBOX_PREFIX = 'fl-';
export const sandboxName = (vmId: string): string => `${SANDBOX_PREFIX}${vmId}`;

export interface SandboxBoot {
  readonly vmId: string;
  readonly tenantId: string;
  readonly spec: Pick<StoredVmSpec, 'cpus' | 'ram_mb' | 'storage_gb' | 'expose' | 'net_raw' | 'egress'> & {
    readonly agent?: Pick<NonNullable<StoredVmSpec['agent']>, 'expose'> | undefined;
  };
  /** Exclusive with `checkpointId`. */
  readonly image?: string | undefined;
  /** A disk to boot from, already on the host (a seed snapshot, or the VM's own disk when it migrates). */
  readonly checkpointId?: string | undefined;
  /** Resume the processes of `checkpointId` (a live checkpoint) instead of booting its disk. */
  readonly resume?: boolean | undefined;
  /** The address to keep if it is free on the host (a live move). */
  readonly ipHint?: string | undefined;
  /** Applied only inside the guest: to the startup script, the in-guest agent and every exec. */
  readonly env: Record<string, string>;
  /** The in-guest agent in clear; `files` empty for a disk that already carries them. */
  readonly agent?: { readonly command: string; readonly drainCommand: string; readonly files: Record<string, string> } | undefined;
  /** A cluster network member: the address its network reserved for it (network-commands.ts). */
  readonly network?: { readonly id: string; readonly subnet: string; readonly ip: string } | undefined;
  /** Written by the create call itself (see `onCreated`'s `files_written`). */
  readonly files?: readonly CreateFile[] | undefined;
  /** The host reservation: the GPU and MIG instance uuids it bound go to the agent, which passes those devices through. */
  readonly reservation?: Pick<VmReservation, 'gpu_uuids' | 'mig_instance_uuids'> | undefined;
}

/**
 * The policy as the agent takes it: always sent, `direct` when the VM named
 * none (the seed's zero value; an agent without the field gives none).
 * Every provider in the registry is served by the host agent's own egress
 * proxy, so no endpoint is named here.
 */
export function agentEgressOf(egress: EgressSpec | undefined): AgentEgress {
  const e = egress ?? { mode: 'direct' as const };
  return {
    mode: e.mode,
    ...(e.provider !== undefined ? { provider: e.provider } : {}),
    allow_out: [...(e.allow_out ?? [])],
    deny_out: [...(e.deny_out ?? [])],
  };
}

export interface BootedSandbox {
  readonly info: VmInfo;
  readonly endpoints: Endpoint[];
}

/**
 * Makes a VM's sandbox on a host, for every flow that boots one (create,
 * fork, migrate): created with every port the VM and its in-guest agent
 * expose (ports are published when the sandbox is made; the in-guest agent
 * only reports them), then `setup` (guest files, startup script), then the
 * in-guest agent. `onCreated` tells the caller there is a sandbox to undo.
 */
export async function bootSandbox(
  agent: HostAgent,
  boot: SandboxBoot,
  hooks: {
    readonly onCreated?: (info: VmInfo) => void;
    readonly setup?: (name: string) => Promise<void>;
    /** Makes the sandbox instead of the agent's createVm (a lazy restore, lazy-migrate.ts). */
    readonly create?: (req: CreateVmRequest) => Promise<VmInfo>;
  } = {},
): Promise<BootedSandbox> {
  const { spec } = boot;
  const name = sandboxName(boot.vmId);
  const expose = [...(spec.agent?.expose ?? []), ...(spec.expose ?? [])];
  const info = await (hooks.create ?? ((r: CreateVmRequest) => agent.createVm(r)))({
    name,
    image: boot.image,
    checkpoint_id: boot.checkpointId,
    cpus: spec.cpus,
    ram_mb: spec.ram_mb,
    storage_gb: spec.storage_gb,
    tenant: boot.tenantId,
    expose,
    ...(spec.net_raw ? { net_raw: true } : {}),
    egress: agentEgressOf(spec.egress),
    env: boot.env,
    ...(boot.resume ? { resume: true } : {}),
    // A network member's address is its network's reservation; otherwise a hint (a live move asks for its old address).
    ...(boot.network
      ? { network: { id: boot.network.id, subnet: boot.network.subnet }, ip_hint: boot.network.ip }
      : boot.ipHint
        ? { ip_hint: boot.ipHint }
        : {}),
    ...(boot.files && boot.files.length > 0 ? { files: [...boot.files] } : {}),
    ...(boot.reservation?.gpu_uuids.length ? { gpu_uuids: [...boot.reservation.gpu_uuids] } : {}),
    ...(boot.reservation?.mig_instance_uuids.length ? { mig_instance_uuids: [...boot.reservation.mig_instance_uuids] } : {}),
  });
  hooks.onCreated?.(info);
  if (boot.network && info.ip !== boot.network.ip) {
    throw new ConflictError(
      'ADDRESS_IN_USE',
      `the host gave ${name} ${info.ip ?? 'no address'}, not ${boot.network.ip} its network reserved (held by a sandbox the control plane does not know)`,
    );
  }
  if (hooks.setup) await hooks.setup(name);
  let endpoints: Endpoint[] = info.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol }));
  if (boot.agent) {
    const started = await agent.startAgent(name, {
      files: boot.agent.files,
      command: boot.agent.command,
      drain_command: boot.agent.drainCommand,
      expose,
    });
    endpoints = started.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol }));
  }
  return { info, endpoints };
}
