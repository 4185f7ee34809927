import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { Pool } from 'pg';
import { z } from 'zod';
import { ForbiddenError, ValidationError } from '@fleet/agent-protocol';
import { queryUsage, queryVmRuns, usageCsv } from '../../projections/billing/billing.queries.js';
import { vmEndReasonSchema } from '../../domain/vm/vm.lifecycle.js';
import { HOUR_MS } from '../../projections/billing/billing.projection.js';
import { problemResponses } from './common.js';

export interface UsageRoutesDeps {
  readonly pool: Pool;
  /** The clock open intervals are billed up to; tests pin it. */
  readonly now?: () => Date;
}

const MAX_SPAN_MS = 366 * 24 * HOUR_MS;

const usageRow = z.object({
  tenant_id: z.string(),
  period_start: z.string(),
  vm_seconds: z.number(),
  cpu_seconds: z.number(),
  ram_mb_seconds: z.number(),
  gpu_seconds: z.record(z.string(), z.number()),
  snapshot_gb_hours: z.number(),
  includes_running: z.boolean(),
});

function hourBoundary(name: 'from' | 'to', value: string): Date {
  const d = new Date(value);
  if (Number.isNaN(d.getTime()))
    throw new ValidationError(`${name} must be an ISO-8601 time, e.g. 2026-01-01T00:00:00Z`, [
      { path: `querystring.${name}`, message: 'not a time' },
    ]);
  if (d.getTime() % HOUR_MS !== 0) {
    throw new ValidationError(
      `${name} must fall on a whole UTC hour (usage is kept per hour), e.g. ${new Date(Math.floor(d.getTime() / HOUR_MS) * HOUR_MS).toISOString()}`,
      [{ path: `querystring.${name}`, message: 'not on an hour boundary' }],
    );
  }
  return d;
}

/**
 * Billing usage per tenant and hour or day. A tenant reads its own usage
 * only; the admin key reads any one tenant (`tenant=`) or all of them.
 */
export function usageRoutes(deps: UsageRoutesDeps) {
  // eslint-disable-next-line @typescript-eslint/require-await -- a fastify plugin that returns no promise must call done()
  return async (scope: FastifyInstance): Promise<void> => {
    const app = scope.withTypeProvider<ZodTypeProvider>();
    app.get(
      '/v1/usage',
      {
        schema: {
          tags: ['usage'],
          summary: 'Billing usage (VM, CPU, RAM MB, GPU seconds; snapshot GB-hours) per period; CSV with Accept: text/csv or format=csv',
          querystring: z.object({
            from: z.string().min(1, 'from is required: an ISO-8601 time on a whole hour'),
            to: z.string().optional(),
            group_by: z.enum(['hour', 'day']).default('hour'),
            tenant: z.string().min(1).max(200).optional(),
            format: z.enum(['json', 'csv']).optional(),
          }),
          response: {
            200: z.object({ from: z.string(), to: z.string(), group_by: z.string(), as_of: z.string(), usage: z.array(usageRow) }),
            ...problemResponses,
          },
        },
      },
      async (req, reply) => {
        const now = (deps.now ?? (() => new Date()))();
        const from = hourBoundary('from', req.query.from);
        const to = req.query.to !== undefined ? hourBoundary('to', req.query.to) : new Date(Math.ceil(now.getTime() / HOUR_MS) * HOUR_MS);
        if (to.getTime() <= from.getTime())
          throw new ValidationError('to must be after from', [{ path: 'querystring.to', message: 'not after from' }]);
        if (to.getTime() - from.getTime() > MAX_SPAN_MS)
          throw new ValidationError('from..to spans more than 366 days; ask for a shorter range', [
            { path: 'querystring.to', message: 'range too long' },
          ]);
        let tenantId: string | undefined;
        if (req.caller.admin) tenantId = req.query.tenant;
        else {
          if (req.query.tenant !== undefined && req.query.tenant !== req.caller.tenantId)
            throw new ForbiddenError('a tenant key reads its own usage only; leave out tenant= or use the admin key');
          tenantId = req.caller.tenantId;
        }
        const rows = await queryUsage(deps.pool, { from, to, groupBy: req.query.group_by, tenantId, now });
        const csv = req.query.format === 'csv' || (req.query.format === undefined && /\btext\/csv\b/i.test(req.headers.accept ?? ''));
        if (csv)
          return reply
            .type('text/csv; charset=utf-8')
            .header('content-disposition', 'inline; filename="usage.csv"')
            .send(usageCsv(rows) as never);
        return { from: from.toISOString(), to: to.toISOString(), group_by: req.query.group_by, as_of: now.toISOString(), usage: rows };
      },
    );

    app.get(
      '/v1/usage/vms',
      {
        schema: {
          tags: ['usage'],
          summary: 'Billing rows per VM run overlapping from..to: what it was billed within the window, and why it ended',
          querystring: z.object({
            from: z.iso.datetime({ offset: true }),
            to: z.iso.datetime({ offset: true }).optional(),
            tenant: z.string().min(1).max(200).optional(),
            reason: vmEndReasonSchema.optional(),
            limit: z.coerce.number().int().min(1).max(10_000).default(1000),
          }),
          response: {
            200: z.object({
              from: z.string(),
              to: z.string(),
              as_of: z.string(),
              vms: z.array(
                z.object({
                  vm_id: z.string(),
                  tenant_id: z.string(),
                  started_at: z.string(),
                  ended_at: z.string().nullable(),
                  reason: z.string().nullable(),
                  exit_code: z.number().nullable(),
                  exit_signal: z.string().nullable(),
                  vm_seconds: z.number(),
                  cpu_seconds: z.number(),
                  ram_mb_seconds: z.number(),
                  gpu_seconds: z.number(),
                  gpu_kind: z.string(),
                }),
              ),
            }),
            ...problemResponses,
          },
        },
      },
      async (req) => {
        const now = (deps.now ?? (() => new Date()))();
        const from = new Date(req.query.from);
        const to = req.query.to !== undefined ? new Date(req.query.to) : now;
        if (to.getTime() <= from.getTime())
          throw new ValidationError('to must be after from', [{ path: 'querystring.to', message: 'not after from' }]);
        let tenantId: string | undefined;
        if (req.caller.admin) tenantId = req.query.tenant;
        else {
          if (req.query.tenant !== undefined && req.query.tenant !== req.caller.tenantId)
            throw new ForbiddenError('a tenant key reads its own usage only; leave out tenant= or use the admin key');
          tenantId = req.caller.tenantId;
        }
        const vms = await queryVmRuns(deps.pool, { from, to, now, tenantId, reason: req.query.reason, limit: req.query.limit });
        return { from: from.toISOString(), to: to.toISOString(), as_of: now.toISOString(), vms };
      },
    );
  };
}
