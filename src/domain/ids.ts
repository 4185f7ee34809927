import { z } from 'zod';
import { ValidationError } from '@fleet/agent-protocol';

/**
 * Entity ids are lowercase `[a-z0-9-]`, 1–64 characters, starting and ending
 * with a letter or digit (a lowercase UUID fits). They become part of stream
 * names (`host-<id>`, `vm-<id>`) and URLs, so nothing else is allowed in.
 */
export const ID_MAX_LENGTH = 64;
export const ID_PATTERN = /^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$/;
const ID_RULE = 'lowercase letters, digits and dashes, 1–64 characters, starting and ending with a letter or digit';

export const idSchema = z.string().regex(ID_PATTERN, `an id: ${ID_RULE}`);

export function isValidId(value: unknown): value is string {
  return typeof value === 'string' && ID_PATTERN.test(value);
}

/** Throws `INVALID_ID` (400) naming the field when `value` is not an id. */
export function assertId(value: unknown, field = 'id'): asserts value is string {
  if (!isValidId(value)) {
    const shown = typeof value === 'string' ? JSON.stringify(value.length > 80 ? `${value.slice(0, 80)}…` : value) : typeof value;
    throw new ValidationError(`${field} ${shown} is not a valid id: use ${ID_RULE}`, [{ path: field, message: ID_RULE }], 'INVALID_ID');
  }
}

export const HOST_STREAM_PREFIX = 'host-';
export const VM_STREAM_PREFIX = 'vm-';

/** The id of a `host-<id>` / `vm-<id>` stream, or undefined when the stream is of another category or malformed. */
export function idFromStream(stream: string, prefix: typeof HOST_STREAM_PREFIX | typeof VM_STREAM_PREFIX): string | undefined {
  if (!stream.startsWith(prefix)) return undefined;
  const id = stream.slice(prefix.length);
  return isValidId(id) ? id : undefined;
}
