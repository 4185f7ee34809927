import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { fold } from '../../src/domain/decider.js';
import { snapshotDecider } from '../../src/domain/snapshot/snapshot.decider.js';
import type { SnapshotEvent } from '../../src/domain/snapshot/snapshot.events.js';
import { quotaUsage, tenantDecider, type TenantEvent } from '../../src/domain/tenant/tenant.decider.js';
import { at, given, T0 } from '../domain/gwt.js';

const ID = 'snap-1';
const requested: SnapshotEvent = {
  type: 'SnapshotRequested',
  data: {
    snapshot_id: ID,
    vm_id: 'vm1',
    tenant_id: 'acme',
    host_id: 'h1',
    arch: 'amd64',
    mode: 'manual',
    comment: '',
    metadata: {},
    ask: { live: true, diff: false, keep_paused: false, shrink: false },
    quota_counted: true,
    at: T0.toISOString(),
  },
};
const taken: SnapshotEvent = {
  type: 'SnapshotTaken',
  data: { snapshot_id: ID, digest: 'a'.repeat(64), size_bytes: 10, kind: 'disk', at: at(1).toISOString() },
};

describe('snapshot decider', () => {
  it('records the kind the agent reported, and the origin as the first holder', () => {
    const s = given(snapshotDecider, [requested])
      .when({ type: 'CompleteSnapshot', data: { snapshot_id: ID, digest: 'a'.repeat(64), size_bytes: 10, kind: 'disk' } }, at(1))
      .thenState();
    assert.ok(s.status === 'ready');
    assert.equal(s.kind, 'disk');
    assert.deepEqual(s.holders, ['h1']);
  });
  it('a second request on the same id is refused; completing twice is idempotent', () => {
    given(snapshotDecider, [requested]).when({ type: 'RequestSnapshot', data: requested.data }).thenThrows('SNAPSHOT_EXISTS', 409);
    given(snapshotDecider, [requested, taken])
      .when({ type: 'CompleteSnapshot', data: { snapshot_id: ID, digest: 'a'.repeat(64), size_bytes: 10, kind: 'disk' } })
      .then([]);
  });
  it('moves add holders once; drops remove them; deleted is terminal and idempotent', () => {
    const moved: SnapshotEvent = {
      type: 'SnapshotArtifactMoved',
      data: {
        snapshot_id: ID,
        from_host_id: 'h1',
        to_host_id: 'h2',
        size_bytes: 10,
        kind: 'disk',
        duration_ms: 5,
        at: at(2).toISOString(),
      },
    };
    given(snapshotDecider, [requested, taken, moved])
      .when({ type: 'RecordArtifactMoved', data: { ...moved.data } })
      .then([]);
    const s = fold(snapshotDecider, [
      requested,
      taken,
      moved,
      { type: 'SnapshotArtifactDropped', data: { snapshot_id: ID, host_id: 'h1', at: at(3).toISOString() } },
    ]);
    assert.deepEqual(s.status !== 'initial' && s.holders, ['h2']);
    const del: SnapshotEvent = {
      type: 'SnapshotDeleted',
      data: { snapshot_id: ID, reason: 'client', forced: false, at: at(4).toISOString() },
    };
    given(snapshotDecider, [requested, taken, del])
      .when({ type: 'DeleteSnapshot', data: { snapshot_id: ID, reason: 'client', forced: false } })
      .then([]);
    given(snapshotDecider, [requested, taken, del])
      .when({ type: 'RecordUse', data: { snapshot_id: ID } })
      .thenThrows('SNAPSHOT_INVALID_STATE', 409);
  });
  it('a snapshot being taken cannot be deleted; an unknown one is not found', () => {
    given(snapshotDecider, [requested])
      .when({ type: 'DeleteSnapshot', data: { snapshot_id: ID, reason: 'client', forced: true } })
      .thenThrows('SNAPSHOT_INVALID_STATE', 409);
    given(snapshotDecider, [])
      .when({ type: 'RecordUse', data: { snapshot_id: ID } })
      .thenThrows('SNAPSHOT_NOT_FOUND', 404);
  });
  it('export intents: requested pending, then updated with status and error', () => {
    const s = fold(snapshotDecider, [
      requested,
      taken,
      { type: 'SnapshotExportRequested', data: { snapshot_id: ID, destination: 's3://b/k', at: at(2).toISOString() } },
      {
        type: 'SnapshotExportUpdated',
        data: { snapshot_id: ID, destination: 's3://b/k', status: 'failed', error: 'denied', at: at(3).toISOString() },
      },
    ]);
    assert.deepEqual(s.status !== 'initial' && s.exports, [
      {
        destination: 's3://b/k',
        status: 'failed',
        requested_at: at(2).toISOString(),
        updated_at: at(3).toISOString(),
        last_error: 'denied',
      },
    ]);
  });
});

describe('tenant quota decider', () => {
  const limits = { max_count: 2, max_bytes: 100 };
  const reserved = (id: string): TenantEvent => ({
    type: 'SnapshotQuotaReserved',
    data: { tenant_id: 'acme', snapshot_id: id, at: T0.toISOString() },
  });
  it('refuses the reservation past the count, naming limit and usage', () => {
    const err = given(tenantDecider, [reserved('a'), reserved('b')])
      .when({ type: 'ReserveSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'c', limits } })
      .thenThrows('QUOTA_EXCEEDED', 429, /2 of 2 snapshots/);
    assert.deepEqual(err.details?.usage, { count: 2, bytes: 0 });
    assert.equal(err.details?.limit, 2);
  });
  it('refuses once bytes reach the limit; a release frees the slot; re-reserving is idempotent', () => {
    const sized: TenantEvent = {
      type: 'SnapshotQuotaSized',
      data: { tenant_id: 'acme', snapshot_id: 'a', size_bytes: 100, at: T0.toISOString() },
    };
    given(tenantDecider, [reserved('a'), sized])
      .when({ type: 'ReserveSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'c', limits } })
      .thenThrows('QUOTA_EXCEEDED', 429, /100 of 100 bytes/);
    const released: TenantEvent = { type: 'SnapshotQuotaReleased', data: { tenant_id: 'acme', snapshot_id: 'a', at: T0.toISOString() } };
    assert.deepEqual(quotaUsage(fold(tenantDecider, [reserved('a'), sized, released])), { count: 0, bytes: 0 });
    given(tenantDecider, [reserved('a')])
      .when({ type: 'ReserveSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'a', limits } })
      .then([]);
  });
  it('the expected size is reserved up front: refused when it would not fit, counted until the real size replaces it', () => {
    const reserve = (id: string, expected: number) => ({
      type: 'ReserveSnapshotQuota' as const,
      data: { tenant_id: 'acme', snapshot_id: id, limits, expected_bytes: expected },
    });
    const err = given(tenantDecider, [reserved('a')])
      .when(reserve('c', 101))
      .thenThrows('QUOTA_EXCEEDED', 429, /0 of 100 bytes in use, this one needs 101/);
    assert.equal(err.details?.needed_bytes, 101);
    const events = given(tenantDecider, []).when(reserve('c', 60)).events();
    assert.equal((events[0]!.data as { expected_bytes?: number }).expected_bytes, 60);
    const held = fold(tenantDecider, events);
    assert.deepEqual(quotaUsage(held), { count: 1, bytes: 60 });
    given(tenantDecider, events)
      .when(reserve('d', 41))
      .thenThrows('QUOTA_EXCEEDED', 429, /60 of 100 bytes/);
    // The real size: smaller is taken as is; larger only if it still fits beside the others.
    given(tenantDecider, events)
      .when({ type: 'SizeSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'c', size_bytes: 30, limits } })
      .then([{ type: 'SnapshotQuotaSized', data: { tenant_id: 'acme', snapshot_id: 'c', size_bytes: 30, at: T0.toISOString() } }]);
    const sibling = [...events, ...given(tenantDecider, events).when(reserve('d', 30)).events()];
    given(tenantDecider, sibling)
      .when({ type: 'SizeSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'c', size_bytes: 71, limits } })
      .thenThrows('QUOTA_EXCEEDED', 429, /30 of 100 bytes in use, this one needs 71/);
    assert.equal(
      given(tenantDecider, sibling)
        .when({ type: 'SizeSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'c', size_bytes: 70, limits } })
        .events().length,
      1,
    );
  });
  it('build snapshots fill a pool of their own, with their own limits; a release frees either', () => {
    const build = (id: string, l = { max_count: 1, max_bytes: 0 }) => ({
      type: 'ReserveSnapshotQuota' as const,
      data: { tenant_id: 'acme', snapshot_id: id, limits: l, pool: 'builds' as const },
    });
    const first = given(tenantDecider, [reserved('a'), reserved('b')])
      .when(build('l1'))
      .events();
    assert.equal((first[0]!.data as { pool?: string }).pool, 'builds');
    const state = fold(tenantDecider, [reserved('a'), reserved('b'), ...first]);
    assert.deepEqual(quotaUsage(state), { count: 2, bytes: 0 }, 'builds are not in the snapshot pool');
    assert.deepEqual(quotaUsage(state, 'builds'), { count: 1, bytes: 0 });
    const err = given(tenantDecider, [reserved('a'), reserved('b'), ...first])
      .when(build('l2'))
      .thenThrows('QUOTA_EXCEEDED', 429, /build snapshot quota exceeded for tenant acme: 1 of 1 build snapshots/);
    assert.equal(err.details?.pool, 'builds');
    const released: TenantEvent = { type: 'SnapshotQuotaReleased', data: { tenant_id: 'acme', snapshot_id: 'l1', at: T0.toISOString() } };
    assert.equal(
      given(tenantDecider, [...first, released])
        .when(build('l2'))
        .events().length,
      1,
    );
    given(tenantDecider, first)
      .when({ type: 'ReserveSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'l1', limits } })
      .then([]);
  });
  it('zero limits disable enforcement', () => {
    const events = given(tenantDecider, [reserved('a'), reserved('b'), reserved('c')])
      .when({ type: 'ReserveSnapshotQuota', data: { tenant_id: 'acme', snapshot_id: 'd', limits: { max_count: 0, max_bytes: 0 } } })
      .events();
    assert.equal(events.length, 1);
  });
});
