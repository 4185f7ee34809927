import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { runBuffered } from '../../packages/agent/src/exec.js';
import { missingFeature, openLab, type Lab } from './support.js';

/**
 * An exec's timeout kills the helper's process group; a guest process that
 * left the group (setsid) survives, which is its right inside its sandbox,
 * but it must not keep the exec's pipes, and so the request, open past the
 * timeout: a tenant could pin any number of agent requests (and control
 * plane calls) for ever with `setsid sleep infinity &`.
 */

const skip = missingFeature();

describe('security review: exec timeout', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 }, () => {
  let lab: Lab;
  before(async () => {
    lab = await openLab([{ name: 'to', storage_gb: 1, tenant: 'rev-a' }]);
  });
  after(async () => {
    await lab?.close();
  });

  test('a daemon that escaped the process group does not hold an exec past its timeout', async () => {
    const t0 = Date.now();
    const r = await Promise.race([
      runBuffered(
        lab.backend,
        'to',
        { argv: ['/bin/sh', '-c', 'setsid sleep 600 & echo hi'], env: {}, timeoutMs: 1500, encoding: 'utf8' },
        1024,
        new AbortController().signal,
      ),
      new Promise<'hung'>((resolve) => setTimeout(() => resolve('hung'), 10_000).unref()),
    ]);
    assert.notEqual(r, 'hung', 'the exec outlived its 1.5 s timeout by more than 8 s');
    if (r === 'hung') return;
    assert.equal(r.timed_out, true);
    assert.equal(r.stdout, 'hi\n', 'output written before the cut is kept');
    assert.ok(Date.now() - t0 < 6000);
  });

  test('a timed-out exec takes what it started with it, though it runs in a session of its own inside the sandbox', async () => {
    const run = (argv: string[], timeoutMs: number) =>
      runBuffered(lab.backend, 'to', { argv, env: {}, timeoutMs, encoding: 'utf8' }, 4096, new AbortController().signal);
    // A background child in the exec's group that keeps the exec's output open, so the exec runs into its timeout.
    const r = await run(['/bin/sh', '-c', 'sleep 777 & echo started; wait'], 1500);
    assert.equal(r.timed_out, true);
    let left = '';
    for (let i = 0; i < 20; i++) {
      left = (await run(['/bin/sh', '-c', 'ps -o args | grep "[s]leep 777" || true'], 5000)).stdout;
      if (left === '') break;
      await new Promise((resolve) => setTimeout(resolve, 250));
    }
    assert.equal(left, '', 'the timed-out exec left its child running');
  });

  test('an exec whose daemon redirected its output ends when the command does', async () => {
    const r = await runBuffered(
      lab.backend,
      'to',
      { argv: ['/bin/sh', '-c', 'setsid sleep 600 </dev/null >/dev/null 2>&1 & echo ok'], env: {}, timeoutMs: 10_000, encoding: 'utf8' },
      1024,
      new AbortController().signal,
    );
    assert.equal(r.timed_out, false);
    assert.equal(r.exit_code, 0);
    assert.equal(r.stdout, 'ok\n');
  });
});
