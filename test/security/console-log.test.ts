import assert from 'node:assert/strict';
import { stat, readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { missingFeature, openLab, sh, type Lab } from './support.js';

/**
 * The console log is on the data directory's filesystem, outside the
 * sandbox's disk: everything the init and its children print lands there.
 * A guest that floods its console (here: a daemon it adds to its own
 * inittab, which busybox init starts with the console as stdout) must not
 * fill the host, and must not be blocked by a console that no longer keeps
 * what it writes.
 */

const skip = missingFeature();
const MAX = 64 * 1024;

describe('security review: the console log is bounded', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 }, () => {
  let lab: Lab;
  before(async () => {
    lab = await openLab([{ name: 'loud', storage_gb: 1, tenant: 'rev-c' }], { consoleLogMaxBytes: MAX });
  });
  after(async () => {
    await lab?.close();
  });

  test('20 MiB written to the console keeps at most the cap on the host, notes the cut, and never blocks the guest', async () => {
    const log = join(lab.dataDir, 'sandboxes', 'loud', 'console.log');
    const flood = `::respawn:/bin/sh -c '[ -e /tmp/flooded ] && exec sleep 100000; head -c 20971520 /dev/zero; touch /tmp/flooded'`;
    const r = await sh(lab.backend, 'loud', `echo "${flood}" >> /etc/inittab && kill -HUP 1 && echo armed`);
    assert.equal(r.stdout.trim(), 'armed', r.stderr);
    let size = 0;
    let flooded = false;
    for (let i = 0; i < 300 && !flooded; i++) {
      flooded = (await sh(lab.backend, 'loud', 'test -e /tmp/flooded && echo yes')).stdout.trim() === 'yes';
      if (!flooded) await new Promise((res) => setTimeout(res, 100));
    }
    assert.ok(flooded, 'the flood finished: the guest was not blocked by its console');
    // The writer appends asynchronously: give it a moment to write its note.
    for (let i = 0; i < 50; i++) {
      size = (await stat(log)).size;
      if ((await readFile(log, 'utf8')).includes('console log cut')) break;
      await new Promise((res) => setTimeout(res, 100));
    }
    assert.ok(size <= MAX + 200, `console.log grew to ${size} bytes (cap ${MAX})`);
    assert.match(await readFile(log, 'utf8'), /console log cut at 65536 bytes/);
    // The sandbox still works.
    const again = await sh(lab.backend, 'loud', 'echo ok');
    assert.equal(again.stdout.trim(), 'ok');
  });
});
