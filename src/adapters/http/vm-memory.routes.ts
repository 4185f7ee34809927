import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import type { VmMemory } from '../../commands/vm/vm-memory.js';
import { problemResponses } from './common.js';
import { actorOf, fromState, vmSchema } from './vms.routes.js';

export interface VmMemoryRoutesDeps {
  readonly memory: VmMemory;
}

/** Pause and resume a VM (memory checkpoints): processes stop and continue where they were; id, token and endpoints stay. */
export function vmMemoryRoutes(deps: VmMemoryRoutesDeps) {
  // eslint-disable-next-line @typescript-eslint/require-await -- fastify waits for done() unless a plugin returns a promise
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    const params = z.object({ id: z.string().min(1).max(64) });
    const response = { 200: vmSchema.extend({ position: z.string().nullable() }), ...problemResponses };
    app.post(
      '/v1/vms/:id/pause',
      {
        schema: {
          tags: ['vms'],
          summary: 'Checkpoint the VM with its memory and stop it; its CPU and memory are released (idempotent)',
          params,
          response,
        },
      },
      async (req) => {
        const r = await deps.memory.pause(req.params.id, actorOf(req));
        return { ...fromState(r.vm), position: r.position ?? null };
      },
    );
    app.post(
      '/v1/vms/:id/resume',
      {
        schema: { tags: ['vms'], summary: 'Resume a paused VM where it stopped; answers once it runs (idempotent)', params, response },
      },
      async (req) => {
        const r = await deps.memory.resume(req.params.id, actorOf(req));
        return { ...fromState(r.vm), position: r.position ?? null };
      },
    );
    app.get(
      '/v1/vms/:id/memory',
      {
        schema: {
          tags: ['vms'],
          summary:
            'Where the VM memory is: done once every page is on its host (at once after a full restore; after a lazy migration, or a restore its host pages in from its own files, resident_chunks of total_chunks count the pages in, and error says the stream from the source, or the paging on its own host, broke)',
          params,
          response: {
            200: z.object({
              resident_chunks: z.number(),
              total_chunks: z.number(),
              done: z.boolean(),
              error: z.string().optional(),
            }),
            ...problemResponses,
          },
        },
      },
      async (req) => deps.memory.memoryStatus(req.params.id, actorOf(req)),
    );
    app.post(
      '/v1/vms/:id/restore',
      {
        schema: {
          tags: ['vms'],
          summary: 'Put the VM back to one of its snapshots on its host (live: its processes resume; disk: a fresh boot)',
          params,
          body: z.object({ snapshot_id: z.string().min(1).max(128) }).strict(),
          response,
        },
      },
      async (req) => {
        const r = await deps.memory.restore(req.params.id, req.body.snapshot_id, actorOf(req));
        return { ...fromState(r.vm), position: r.position ?? null };
      },
    );
  };
}
