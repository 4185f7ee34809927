import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { healthDecider, nextHealth } from '../../src/domain/health/health.decider.js';
import type { HealthEvent } from '../../src/domain/health/health.events.js';
import { at, given, T0 } from '../domain/gwt.js';

describe('health verdicts', () => {
  test('docker rules: a pass is healthy; failures in the start period keep starting; more than retries make unhealthy', () => {
    const spec = { retries: 2, start_period_seconds: 10 };
    assert.equal(nextHealth('unknown', true, 0, spec, 0), 'healthy');
    assert.equal(nextHealth('unknown', false, 5, spec, 5_000), 'starting', 'inside the start period');
    assert.equal(nextHealth('unknown', false, 1, spec, 20_000), 'starting');
    assert.equal(nextHealth('healthy', false, 2, spec, 20_000), 'healthy', 'retries not exceeded');
    assert.equal(nextHealth('healthy', false, 3, spec, 20_000), 'unhealthy');
    assert.equal(nextHealth('unhealthy', true, 0, spec, 30_000), 'healthy');
    assert.equal(nextHealth('unknown', false, 4, {}, 0), 'unhealthy', 'defaults: 3 retries, no start period');
  });

  test('only a change of state is recorded', () => {
    const changed: HealthEvent = {
      type: 'VmHealthChanged',
      data: { vm_id: 'v1', state: 'unhealthy', since: at(5).toISOString(), failures: 4, message: 'exit 1' },
    };
    given(healthDecider)
      .when({ type: 'RecordHealthVerdict', data: { vm_id: 'v1', state: 'unhealthy', failures: 4, message: 'exit 1' } }, at(5))
      .then([changed]);
    given(healthDecider, [changed])
      .when({ type: 'RecordHealthVerdict', data: { vm_id: 'v1', state: 'unhealthy', failures: 9, message: 'exit 2' } })
      .then([]);
    const back = given(healthDecider, [changed])
      .when({ type: 'RecordHealthVerdict', data: { vm_id: 'v1', state: 'healthy', failures: 0, message: '' } }, T0)
      .thenState();
    assert.deepEqual(back, { status: 'healthy', since: T0.toISOString(), failures: 0, message: '' });
  });
});
