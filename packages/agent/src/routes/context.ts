import type { FastifyRequest } from 'fastify';
import type { VmInfo } from '@fleet/agent-protocol';
import { AppError } from '@fleet/agent-protocol';
import type { Backend, SandboxInfo } from '../backend.js';
import type { ExecLimits } from '../exec.js';
import type { GuestAgentStore } from '../guest-agents.js';
import { paramOf, sandboxName } from './route-schema.js';

/** The host agent's HTTP settings (from AGENT_* variables, see config.ts). */
export interface AgentAppConfig {
  token: string;
  grantSecret: Buffer;
  dataDir: string;
  execDefaultTimeoutMs: number;
  execMaxTimeoutMs: number;
  outputCapBytes: number;
  maxUploadBytes: number;
  pullTimeoutMs: number;
}

/** What every route group of the host agent shares, built once by buildAgentApp. */
export interface AgentRouteContext {
  backend: Backend;
  config: AgentAppConfig;
  limits: ExecLimits;
  guestAgents: GuestAgentStore;
  /** Snapshot ids being pulled right now: prune leaves their staging alone. */
  activePulls: Set<string>;
  now: () => number;
  /** Runs a command in the sandbox and returns its stdout; a non-zero exit is AGENT_START_FAILED. */
  checkedRun: (name: string, argv: string[], what: string, env?: Record<string, string>) => Promise<string>;
}

/** The `:name` of a route that declares no schema object of its own (envd's pass-through). */
export function nameParam(req: FastifyRequest): string {
  return paramOf(req, { name: sandboxName }, 'name');
}

export function isCode(err: unknown, code: string): boolean {
  return err instanceof AppError && err.code === code;
}

export function toVmInfo(s: SandboxInfo): VmInfo {
  return {
    name: s.name,
    state: s.state,
    image: s.image,
    tenant: s.tenant,
    ...(s.ip ? { ip: s.ip } : {}),
    ...(s.mac ? { mac: s.mac } : {}),
    cpus: s.cpus,
    ram_mb: s.ram_mb,
    created_at: s.created_at,
    ...(s.checkpoint_id ? { from_checkpoint: s.checkpoint_id } : {}),
    endpoints: s.endpoints.map((e) => ({ as: e.as, url: e.url, port: e.port, protocol: e.protocol })),
    ...(s.egress ? { egress: s.egress } : {}),
  };
}
