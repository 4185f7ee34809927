import assert from 'node:assert/strict';
import { test } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import { hostStream } from '../../src/domain/host/host.aggregate.js';
import { assertId, HOST_STREAM_PREFIX, idFromStream, isValidId, VM_STREAM_PREFIX } from '../../src/domain/ids.js';
import { vmStream } from '../../src/domain/vm/vm.aggregate.js';
import { assertStreamName } from '../../src/domain/event-store.port.js';

test('ids: lowercase [a-z0-9-], 1–64, alphanumeric at both ends', () => {
  for (const ok of ['a', 'h1', 'vm-123', '6f1c2d3e-0a1b-4c5d-8e9f-0123456789ab', 'a'.repeat(64)]) assert.ok(isValidId(ok), ok);
  for (const bad of ['', 'A', 'a_b', '-a', 'a-', 'a'.repeat(65), 'a/b', 'é', 'a b', 12, null]) assert.ok(!isValidId(bad), String(bad));
});

test('ids: assertId throws INVALID_ID naming the field', () => {
  assert.throws(
    () => assertId('Bad_Id', 'host_id'),
    (e: unknown) => e instanceof AppError && e.code === 'INVALID_ID' && e.status === 400 && /host_id "Bad_Id"/.test(e.message),
  );
});

test('ids: stream helpers build valid stream names and read them back', () => {
  assert.equal(hostStream('h1'), 'host-h1');
  assert.equal(vmStream('v-1'), 'vm-v-1');
  assertStreamName(hostStream('h1'));
  assertStreamName(vmStream('6f1c2d3e-0a1b-4c5d-8e9f-0123456789ab'));
  assert.equal(idFromStream('vm-v-1', VM_STREAM_PREFIX), 'v-1');
  assert.equal(idFromStream('host-h1', VM_STREAM_PREFIX), undefined);
  assert.equal(idFromStream('host-H1', HOST_STREAM_PREFIX), undefined);
  assert.throws(
    () => vmStream('../etc'),
    (e: unknown) => e instanceof AppError && e.code === 'INVALID_ID',
  );
});
