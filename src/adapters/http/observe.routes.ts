import type { ServerResponse } from 'node:http';
import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { AppError, metricSampleSchema } from '@fleet/agent-protocol';
import type { HostCommands } from '../../commands/host/host-commands.js';
import { sandboxName, type VmCommands } from '../../commands/vm/vm-commands.js';
import type { HostAgent } from '../../domain/host-agent.port.js';
import { idSchema } from '../../domain/ids.js';
import type { ExistingVmState } from '../../domain/vm/vm.decider.js';
import { problemResponses } from './common.js';

export interface ObserveRoutesDeps {
  readonly vms: VmCommands;
  readonly hosts: HostCommands;
  /** How often a follower asks the host for new console bytes. */
  readonly logPollMs?: number;
  /** A follow stream ends after this long (the client resumes with ?offset=). */
  readonly followMaxMs?: number;
  readonly heartbeatMs?: number;
  /** Open follow streams per caller (per replica); one more is refused with 429 TOO_MANY_LOG_STREAMS. */
  readonly maxFollowsPerCaller?: number;
}

const params = z.object({ id: idSchema });

const metricsOut = z.object({
  vm_id: z.string(),
  host_id: z.string(),
  interval_ms: z.number(),
  window: z.number(),
  samples: z.array(metricSampleSchema),
});

const logsQuery = z.object({
  follow: z
    .enum(['true', 'false', '1', '0'])
    .default('false')
    .transform((v) => v === 'true' || v === '1'),
  /** Byte offset in the whole console (previous file, then current), as returned in `next_offset`. */
  offset: z.coerce.number().int().nonnegative().optional(),
  /** Without offset: the last this many bytes. */
  tail_bytes: z.coerce
    .number()
    .int()
    .min(1)
    .max(16 * 1024 * 1024)
    .default(256 * 1024),
});

function notObservable(what: string): AppError {
  return new AppError('NOT_IMPLEMENTED', 501, `this host's agent does not serve ${what}`);
}

async function agentOf(deps: ObserveRoutesDeps, vm: ExistingVmState): Promise<{ agent: HostAgent; hostId: string }> {
  if (!vm.host_id) throw new AppError('VM_NOT_PLACED', 409, `vm ${vm.vm_id} was never placed on a host (it is ${vm.status})`);
  return { agent: await deps.hosts.agentFor(vm.host_id), hostId: vm.host_id };
}

/**
 * Per-VM metrics and console logs, read from the VM's host agent, for the
 * VM's tenant (another tenant's VM is a 404) or an admin. Logs stay
 * readable after the VM ended for the agent's AGENT_LOG_RETENTION_MS.
 */
export function observeRoutes(deps: ObserveRoutesDeps) {
  const pollMs = deps.logPollMs ?? 500;
  const followMaxMs = deps.followMaxMs ?? 3_600_000;
  const heartbeatMs = deps.heartbeatMs ?? 15_000;
  const maxFollows = deps.maxFollowsPerCaller ?? 8;
  const follows = new Map<string, number>();
  return (scope: FastifyInstance): void => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    // Open follows would keep the server from closing: they end (with `event: end`) first.
    const open = new Set<() => void>();
    app.addHook('preClose', async () => {
      for (const end of [...open]) end();
      await Promise.resolve();
    });

    app.get(
      '/v1/vms/:id/metrics',
      {
        schema: {
          tags: ['vms'],
          summary: "The VM's resource samples (CPU time, memory and peak, disk of its writable layer, network bytes, pids), oldest first",
          params,
          querystring: z.object({
            /** Unix milliseconds or an ISO time: samples strictly after it. */
            since: z
              .string()
              .optional()
              .transform((v, ctx) => {
                if (v === undefined || v === '') return 0;
                const n = /^\d+$/.test(v) ? Number(v) : Date.parse(v);
                if (!Number.isFinite(n)) {
                  ctx.addIssue({ code: 'custom', message: 'since must be unix milliseconds or an ISO 8601 time' });
                  return z.NEVER;
                }
                return n;
              }),
          }),
          response: { 200: metricsOut, ...problemResponses },
        },
      },
      async (req) => {
        const vm = await deps.vms.get(req.params.id, { tenantId: req.caller.tenantId, admin: req.caller.admin });
        if (vm.status !== 'running')
          throw new AppError('VM_NOT_RUNNING', 409, `vm ${vm.vm_id} is ${vm.status}: metrics are sampled while it runs`, {
            vm_id: vm.vm_id,
            status: vm.status,
          });
        const { agent, hostId } = await agentOf(deps, vm);
        if (!agent.metrics) throw notObservable('metrics');
        const m = await agent.metrics(sandboxName(vm.vm_id), req.query.since);
        return { vm_id: vm.vm_id, host_id: hostId, ...m };
      },
    );

    app.get(
      '/v1/vms/:id/logs',
      {
        schema: {
          tags: ['vms'],
          summary:
            "The VM's console (init output, startup script, in-guest agent) as text; ?follow=true streams it as Server-Sent Events (`log` events with {data, next_offset}, `end` once the VM is gone)",
          params,
          querystring: logsQuery,
        },
      },
      async (req, reply) => {
        const vm = await deps.vms.get(req.params.id, { tenantId: req.caller.tenantId, admin: req.caller.admin });
        const { agent } = await agentOf(deps, vm);
        const logs = agent.logs?.bind(agent);
        if (!logs) throw notObservable('logs');
        const name = sandboxName(vm.vm_id);
        const first = await logs(name, {
          ...(req.query.offset !== undefined ? { offset: req.query.offset } : {}),
          tailBytes: req.query.tail_bytes,
        });
        if (!req.query.follow) {
          return reply
            .header('fleet-log-next-offset', String(first.next_offset))
            .header('fleet-log-ended', String(first.ended))
            .type('text/plain; charset=utf-8')
            .send(Buffer.from(first.data, 'base64'));
        }

        // Each follow polls the host twice a second: a caller gets a bounded number of them.
        const who = req.caller.admin ? 'admin' : req.caller.tenantId;
        const already = follows.get(who) ?? 0;
        if (already >= maxFollows)
          throw new AppError('TOO_MANY_LOG_STREAMS', 429, `you already follow ${already} logs; close one (at most ${maxFollows})`, {
            limit: maxFollows,
          });
        follows.set(who, already + 1);
        const release = (): void => {
          const n = (follows.get(who) ?? 1) - 1;
          if (n <= 0) follows.delete(who);
          else follows.set(who, n);
        };

        reply.hijack();
        const res: ServerResponse = reply.raw;
        res.writeHead(200, {
          'content-type': 'text/event-stream; charset=utf-8',
          'cache-control': 'no-cache, no-transform',
          connection: 'keep-alive',
          'x-accel-buffering': 'no',
        });
        const conn = { closed: false, shuttingDown: false };
        const started = Date.now();
        let lastWrite = Date.now();
        res.once('close', () => (conn.closed = true));
        const isClosed = (): boolean => conn.closed;
        const stop = (): void => {
          conn.closed = true;
          conn.shuttingDown = true;
        };
        open.add(stop);
        const send = (event: string, body: unknown): void => {
          res.write(`event: ${event}\ndata: ${JSON.stringify(body)}\n\n`);
          lastWrite = Date.now();
        };
        // A chunk may end inside a UTF-8 sequence: the client gets whole characters, the rest waits for the next chunk.
        let pending = Buffer.alloc(0);
        const emit = (b64: string, next: number): void => {
          const bytes = Buffer.concat([pending, Buffer.from(b64, 'base64')]);
          const cut = completeUtf8(bytes);
          pending = bytes.subarray(cut);
          if (cut > 0) send('log', { data: bytes.subarray(0, cut).toString('utf8'), next_offset: next - pending.length });
        };
        let offset = first.next_offset;
        let ended = first.ended;
        try {
          emit(first.data, offset);
          while (!isClosed()) {
            if (ended) {
              send('end', { next_offset: offset, reason: 'the VM is gone: nothing more will be written' });
              break;
            }
            if (Date.now() - started > followMaxMs) {
              send('end', { next_offset: offset, reason: 'follow time limit: resume with ?follow=true&offset=' });
              break;
            }
            await new Promise((r) => setTimeout(r, pollMs));
            if (isClosed()) break;
            const r = await logs(name, { offset }, { timeoutMs: 10_000 }).catch((err: unknown) => {
              // Destroyed and not kept (AGENT_LOG_RETENTION_MS=0): the end, not an error.
              if (err instanceof AppError && err.code === 'SANDBOX_NOT_FOUND') return { data: '', next_offset: offset, ended: true };
              throw err;
            });
            if (r.data.length > 0) emit(r.data, r.next_offset);
            offset = r.next_offset;
            ended = r.ended;
            if (Date.now() - lastWrite > heartbeatMs) {
              res.write(`: heartbeat ${new Date().toISOString()}\n\n`);
              lastWrite = Date.now();
            }
          }
          if (conn.shuttingDown && !res.destroyed)
            send('end', { next_offset: offset, reason: 'the server is shutting down: resume with ?follow=true&offset=' });
        } catch (err) {
          if (!res.destroyed) {
            const e = err instanceof AppError ? err : undefined;
            send('error', {
              code: e?.code ?? 'INTERNAL',
              message: e && e.status < 500 ? e.message : 'the host stopped answering: resume with ?offset=',
            });
          }
        } finally {
          open.delete(stop);
          release();
          res.end();
        }
      },
    );
  };
}

/** Length of the prefix of `b` that ends on a UTF-8 character boundary. */
function completeUtf8(b: Buffer): number {
  for (let i = b.length - 1, back = 0; i >= 0 && back < 4; i--, back++) {
    const c = b[i] ?? 0;
    if ((c & 0xc0) === 0x80) continue;
    const need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    return b.length - i >= need ? b.length : i;
  }
  return b.length;
}
