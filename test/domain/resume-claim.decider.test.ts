import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import type { RecordedEvent } from '../../src/domain/event-store.port.js';
import { decodeResumeClaimEvent, resumeClaimDecider, type ResumeClaimCommand } from '../../src/domain/vm/resume-claim.decider.js';
import type { ResumeClaimEvent } from '../../src/domain/vm/resume-claim.events.js';
import { at, given, T0 } from './gwt.js';

const LEASE = 300_000;
const claim = (id: string): ResumeClaimCommand => ({ type: 'ClaimResume', data: { vm_id: 'v1', claim_id: id, lease_ms: LEASE } });
const claimed = (id: string, seconds: number): ResumeClaimEvent => ({
  type: 'VmResumeClaimed',
  data: { vm_id: 'v1', claim_id: id, until: new Date(at(seconds).getTime() + LEASE).toISOString(), at: at(seconds).toISOString() },
});
const ended = (id: string, outcome: 'resumed' | 'failed' | 'not_needed', seconds: number): ResumeClaimEvent => ({
  type: 'VmResumeClaimEnded',
  data: { vm_id: 'v1', claim_id: id, outcome, at: at(seconds).toISOString() },
});

describe('resume claim decider', () => {
  test('the first claim is granted; a second while it is open is not (its caller waits); a retry of the first is a no-op', () => {
    given(resumeClaimDecider)
      .when(claim('a'))
      .then([claimed('a', 0)]);
    given(resumeClaimDecider, [claimed('a', 0)])
      .when(claim('b'), at(1))
      .then([]);
    given(resumeClaimDecider, [claimed('a', 0)])
      .when(claim('a'), at(1))
      .then([]);
  });

  test('an ended claim frees the VM for the next; an expired one is taken over; only its holder ends a claim', () => {
    given(resumeClaimDecider, [claimed('a', 0), ended('a', 'failed', 2)])
      .when(claim('b'), at(3))
      .then([claimed('b', 3)]);
    given(resumeClaimDecider, [claimed('a', 0)])
      .when(claim('b'), at(301))
      .then([claimed('b', 301)]);
    given(resumeClaimDecider, [claimed('a', 0)])
      .when({ type: 'EndResumeClaim', data: { vm_id: 'v1', claim_id: 'b', outcome: 'resumed' } }, at(5))
      .then([]);
    given(resumeClaimDecider, [claimed('a', 0)])
      .when({ type: 'EndResumeClaim', data: { vm_id: 'v1', claim_id: 'a', outcome: 'resumed' } }, at(5))
      .then([ended('a', 'resumed', 5)]);
  });

  test('its holder renews a claim once half its lease has passed; a renewal never grants (ended, or held by another)', () => {
    const renew = (id: string): ResumeClaimCommand => ({ type: 'RenewResumeClaim', data: { vm_id: 'v1', claim_id: id, lease_ms: LEASE } });
    given(resumeClaimDecider, [claimed('a', 0)])
      .when(renew('a'), at(151))
      .then([claimed('a', 151)]);
    given(resumeClaimDecider, [claimed('a', 0)])
      .when(renew('a'), at(149))
      .then([]);
    given(resumeClaimDecider, [claimed('a', 0), claimed('b', 301)])
      .when(renew('a'), at(302))
      .then([]);
    // A renewal that lands after its claim ended (it was in flight) leaves the VM free.
    given(resumeClaimDecider, [claimed('a', 0), ended('a', 'resumed', 200)])
      .when(renew('a'), at(201))
      .then([]);
    given(resumeClaimDecider, [claimed('a', 0)])
      .when(renew('b'), at(400))
      .then([]);
  });

  test('events parse back from their stored form', () => {
    for (const e of [claimed('a', 0), ended('a', 'not_needed', 1)]) {
      const stored = { type: e.type, data: JSON.parse(JSON.stringify(e.data)) as unknown } as unknown as RecordedEvent;
      assert.deepEqual(decodeResumeClaimEvent(stored), e);
    }
    assert.throws(() =>
      decodeResumeClaimEvent({ type: 'VmResumeClaimed', data: { vm_id: 'v1', at: T0.toISOString() } } as unknown as RecordedEvent),
    );
  });
});
