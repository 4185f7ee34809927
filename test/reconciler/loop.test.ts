import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { pino } from 'pino';
import { Reconciler, type ReconcilerConfig, type ReconcileSummary } from '../../src/commands/reconcile/reconciler.js';

const CONFIG: ReconcilerConfig = {
  intervalMs: 50,
  taskStuckTimeoutMs: 0,
  defaultIdleTimeoutMs: 0,
  orphanDestroyMaxRetries: 5,
  hostUnreachableAfterCycles: 3,
  halfDoneGraceMs: 60_000,
  agentTimeoutMs: 1000,
  activityCoalesceMs: 0,
};

/** The loop's lifecycle, with an empty fleet (no hosts, no VMs): nothing else is touched. */
describe('reconcile loop', () => {
  test('a lease lost and won again mid-cycle leaves exactly one loop; stop waits for the cycle in flight', async () => {
    let inFlight = 0;
    let maxInFlight = 0;
    const cycles: ReconcileSummary[] = [];
    const slowEmpty = async <T>(v: T): Promise<T> => {
      inFlight++;
      maxInFlight = Math.max(maxInFlight, inFlight);
      await new Promise((r) => setTimeout(r, 30));
      inFlight--;
      return v;
    };
    const r = new Reconciler(
      null as never,
      null as never,
      null as never,
      { hostIds: () => slowEmpty([]), liveVms: () => slowEmpty([]) },
      CONFIG,
      pino({ level: 'silent' }),
      (s) => cycles.push(s),
    );
    r.start();
    await new Promise((res) => setTimeout(res, 10)); // a cycle is in flight
    const stopping = r.stop();
    r.start(); // won again before the old cycle ended
    await stopping;
    await new Promise((res) => setTimeout(res, 600));
    await r.stop();
    const n = cycles.length;
    // One loop: a cycle (~30 ms) then a 50 ms pause → at most ~8 in 600 ms; two loops would run ~15.
    assert.ok(n >= 4 && n <= 10, `cycles: ${n}`);
    assert.equal(maxInFlight, 2, 'hostIds and liveVms of one cycle run together; never two cycles at once');
    await new Promise((res) => setTimeout(res, 200));
    assert.equal(cycles.length, n, 'no cycle after stop');
    assert.equal(r.isActive, false);
  });
});
