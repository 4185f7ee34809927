import { z } from 'zod';
import { idSchema } from '../ids.js';
import { parseStoredEvent } from '../stored-event.js';

export const NETWORK_STREAM_PREFIX = 'network-';
/** One stream holds every subnet handed out of the pool, so two networks never overlap (checked by its decider). */
export const NETWORK_POOL_STREAM = 'netpool-default';

const at = z.iso.datetime({ offset: true });
export const networkNameSchema = z
  .string()
  .regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$/, 'a name of 1-63 letters, digits, ".", "_" or "-", starting with a letter or digit');

export const networkCreatedSchema = z.object({
  type: z.literal('NetworkCreated'),
  data: z.object({ network_id: idSchema, tenant_id: z.string().min(1), name: networkNameSchema, subnet: z.string(), at }),
});
/** A member's address on the network (Reserve) and the host it runs on: the first live member's host pins the network. */
export const networkMemberJoinedSchema = z.object({
  type: z.literal('NetworkMemberJoined'),
  data: z.object({ network_id: idSchema, vm_id: idSchema, ip: z.ipv4(), host_id: idSchema, at }),
});
export const networkDeletedSchema = z.object({
  type: z.literal('NetworkDeleted'),
  data: z.object({ network_id: idSchema, at }),
});

export const networkEventSchema = z.discriminatedUnion('type', [networkCreatedSchema, networkMemberJoinedSchema, networkDeletedSchema]);
export type NetworkEvent = z.infer<typeof networkEventSchema>;
const NETWORK_EVENT_TYPES: ReadonlySet<string> = new Set(networkEventSchema.options.map((o) => o.shape.type.value));
export const isNetworkEventType = (type: string): boolean => NETWORK_EVENT_TYPES.has(type);
export const parseNetworkEvent = (type: string, data: unknown): NetworkEvent => parseStoredEvent(networkEventSchema, type, data);

export const subnetAllocatedSchema = z.object({
  type: z.literal('SubnetAllocated'),
  data: z.object({ network_id: idSchema, subnet: z.string(), at }),
});
export const subnetReleasedSchema = z.object({
  type: z.literal('SubnetReleased'),
  data: z.object({ network_id: idSchema, at }),
});
export const poolEventSchema = z.discriminatedUnion('type', [subnetAllocatedSchema, subnetReleasedSchema]);
export type PoolEvent = z.infer<typeof poolEventSchema>;
const POOL_EVENT_TYPES: ReadonlySet<string> = new Set(poolEventSchema.options.map((o) => o.shape.type.value));
export const isPoolEventType = (type: string): boolean => POOL_EVENT_TYPES.has(type);
export const parsePoolEvent = (type: string, data: unknown): PoolEvent => parseStoredEvent(poolEventSchema, type, data);
