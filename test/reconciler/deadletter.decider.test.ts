import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { deadLetterDecider, type DeadLetterCommand } from '../../src/domain/deadletter/deadletter.decider.js';
import { deadLetterEventSchema, type DeadLetterEvent } from '../../src/domain/deadletter/deadletter.events.js';
import { at, given, T0 } from '../domain/gwt.js';

const record = (retry_count = 5): DeadLetterCommand => ({
  type: 'RecordDeadLetter',
  data: {
    id: 'dl1',
    kind: 'orphan_destroy',
    entity_id: 'fl-abc',
    host_id: 'h1',
    reason: 'agent 500',
    error_code: 'AGENT_ERROR',
    retry_count,
    first_failed_at: T0.toISOString(),
  },
});
const lettered = (retry_count = 5, when = T0): DeadLetterEvent => ({
  type: 'DeadLettered',
  data: {
    id: 'dl1',
    kind: 'orphan_destroy',
    entity_id: 'fl-abc',
    host_id: 'h1',
    reason: 'agent 500',
    error_code: 'AGENT_ERROR',
    retry_count,
    first_failed_at: T0.toISOString(),
    at: when.toISOString(),
  },
});
const retried: DeadLetterEvent = { type: 'DeadLetterRetryRequested', data: { id: 'dl1', actor: 'admin', at: at(10).toISOString() } };

describe('dead-letter decider', () => {
  test('records once; a second record of an open letter changes nothing', () => {
    given(deadLetterDecider).when(record()).then([lettered()]);
    given(deadLetterDecider, [lettered()]).when(record()).then([]);
    assert.ok(deadLetterEventSchema.safeParse(lettered()).success);
  });

  test('retry: open → retrying; failing again dead-letters it with the counts added up and the first failure kept', () => {
    given(deadLetterDecider, [lettered()])
      .when({ type: 'RetryDeadLetter', data: { id: 'dl1', actor: 'admin' } }, at(10))
      .then([retried]);
    given(deadLetterDecider, [lettered(), retried])
      .when({ type: 'RetryDeadLetter', data: { id: 'dl1', actor: 'admin' } })
      .then([]);
    const again = given(deadLetterDecider, [lettered(), retried]).when(record(5), at(20)).events();
    assert.equal(again[0]?.type, 'DeadLettered');
    assert.ok(again[0]?.type === 'DeadLettered' && again[0].data.retry_count === 10 && again[0].data.first_failed_at === T0.toISOString());
  });

  test('resolve ends it; a resolved letter cannot be retried or discarded', () => {
    const resolved: DeadLetterEvent = { type: 'DeadLetterResolved', data: { id: 'dl1', outcome: 'succeeded', at: at(11).toISOString() } };
    given(deadLetterDecider, [lettered(), retried])
      .when({ type: 'ResolveDeadLetter', data: { id: 'dl1', outcome: 'succeeded' } }, at(11))
      .then([resolved]);
    given(deadLetterDecider, [lettered(), retried, resolved])
      .when({ type: 'RetryDeadLetter', data: { id: 'dl1', actor: 'a' } })
      .thenThrows('DEAD_LETTER_RESOLVED', 409);
    given(deadLetterDecider, [lettered(), retried, resolved])
      .when({ type: 'DiscardDeadLetter', data: { id: 'dl1', actor: 'a' } })
      .thenThrows('DEAD_LETTER_RESOLVED', 409);
    given(deadLetterDecider, [lettered(), retried, resolved])
      .when({ type: 'ResolveDeadLetter', data: { id: 'dl1', outcome: 'gone' } })
      .then([]);
  });

  test('discard is final for the reconciler: a later failure is not recorded again; unknown letters are 404', () => {
    const discarded: DeadLetterEvent = {
      type: 'DeadLetterDiscarded',
      data: { id: 'dl1', actor: 'admin', note: 'by hand', at: at(5).toISOString() },
    };
    given(deadLetterDecider, [lettered()])
      .when({ type: 'DiscardDeadLetter', data: { id: 'dl1', actor: 'admin', note: 'by hand' } }, at(5))
      .then([discarded]);
    given(deadLetterDecider, [lettered(), discarded]).when(record()).then([]);
    given(deadLetterDecider, [lettered(), discarded])
      .when({ type: 'DiscardDeadLetter', data: { id: 'dl1', actor: 'admin' } })
      .then([]);
    given(deadLetterDecider)
      .when({ type: 'RetryDeadLetter', data: { id: 'dl1', actor: 'a' } })
      .thenThrows('DEAD_LETTER_NOT_FOUND', 404);
    given(deadLetterDecider)
      .when({ type: 'DiscardDeadLetter', data: { id: 'dl1', actor: 'a' } })
      .thenThrows('DEAD_LETTER_NOT_FOUND', 404);
  });
});
