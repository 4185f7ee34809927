import assert from 'node:assert/strict';
import { stat } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { missingFeature, openLab, sh, type Lab } from './support.js';

/**
 * The init's stdout is a host file that every process the init starts
 * inherits; the guest controls its /etc/inittab and can SIGHUP its init, so
 * it can write to that file without end. With a disk of its own, those
 * bytes must count against storage_gb, not fill the data directory's
 * filesystem (which, embedded, also holds Postgres).
 */

const skip = missingFeature();

describe('security review: console log', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 }, () => {
  let lab: Lab;
  before(async () => {
    lab = await openLab([{ name: 'con', storage_gb: 1, tenant: 'rev-a' }]);
  });
  after(async () => {
    await lab?.close();
  });

  test("what the guest's init writes lands on the sandbox's own disk, and is counted in its usage", async () => {
    const b = lab.backend;
    const info = await b.get('con');
    const disk = join(b.sandboxDir('con'), 'disk');
    const usage0 = await b.layerUsage('con');
    const r = await sh(b, 'con', `echo '::respawn:/bin/sh -c "head -c 20000000 /dev/zero; exec sleep 1000"' >> /etc/inittab && kill -HUP 1 && sleep 0.2`);
    assert.equal(r.exitCode, 0, r.stderr);
    let size = 0;
    for (let i = 0; i < 100 && size < 20_000_000; i++) {
      size = await stat(info.console_log).then((s) => s.size, () => 0);
      await new Promise((res) => setTimeout(res, 100));
    }
    assert.ok(size >= 20_000_000, `the init's output did not reach the console log (${size} bytes): the attack did not run`);
    assert.equal((await stat(info.console_log)).dev, (await stat(disk)).dev, `console log ${info.console_log} is not on the sandbox's disk`);
    const usage1 = await b.layerUsage('con');
    assert.ok(usage1.used_bytes - usage0.used_bytes >= 19_000_000, `usage grew by ${usage1.used_bytes - usage0.used_bytes} bytes only`);
  });
});
