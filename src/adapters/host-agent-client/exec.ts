import type { z } from 'zod';
import { type AttachStart, type ExecRequest, type ExecResult, type ExecStreamStart, execResultSchema } from '@fleet/agent-protocol';
import { type AgentStream, type CallOptions, type StreamOptions } from '../../domain/host-agent.port.js';
import { type AgentTransport, seg, type RequestSpec } from './transport.js';

/** Commands in a sandbox: exec, and the exec/attach streams. */
export class ExecRoutes {
  readonly #t: AgentTransport;

  constructor(transport: AgentTransport) {
    this.#t = transport;
  }

  #call<S extends z.ZodType>(spec: RequestSpec<S> & { schema: S }): Promise<z.infer<S>> {
    return this.#t.call(spec);
  }

  #stream(path: string, start: object, opts?: StreamOptions): Promise<AgentStream> {
    return this.#t.stream(path, start, opts);
  }

  exec(name: string, req: ExecRequest, opts?: CallOptions): Promise<ExecResult> {
    return this.#call({
      method: 'POST',
      path: `/vms/${seg(name)}/exec`,
      json: req,
      schema: execResultSchema,
      idempotent: false,
      opts,
      // The agent's default exec timeout is 30 s; the call must outlive the command it waits for.
      extraTimeoutMs: req.timeout_ms || 30_000,
    });
  }

  execStream(name: string, start: ExecStreamStart, opts?: StreamOptions): Promise<AgentStream> {
    return this.#stream(`/vms/${seg(name)}/exec`, start, opts);
  }

  attach(name: string, start: AttachStart, opts?: StreamOptions): Promise<AgentStream> {
    return this.#stream(`/vms/${seg(name)}/attach`, start, opts);
  }
}
