import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import { collect, missingFeature, openLab, type Lab } from './support.js';

/**
 * The guest environment travels hex-encoded (twice its bytes) in the
 * helper's own environment: a value over about 64 KiB, or a few hundred
 * KiB in all, exceeds the kernel's exec limits. That is the caller's input:
 * a 400 naming the limit, not a failed sandbox (a 500).
 */

const skip = missingFeature();

describe('security review: exec size limits', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 }, () => {
  let lab: Lab;
  before(async () => {
    lab = await openLab([{ name: 'sz', storage_gb: 1, tenant: 'rev-a' }]);
  });
  after(async () => {
    await lab?.close();
  });

  const is400 = (err: unknown): boolean => err instanceof AppError && err.status === 400;

  test('one environment value over the kernel limit, or too much in all, is a 400; a large admissible one reaches the guest whole', async () => {
    const b = lab.backend;
    await assert.rejects(
      b.spawn('sz', { argv: ['/bin/true'], stdin: false, env: { BIG: 'x'.repeat(100 * 1024) } }).then((h) => h.wait()),
      is400,
    );
    const many = Object.fromEntries(Array.from({ length: 40 }, (_, i) => [`V${i}`, 'z'.repeat(60 * 1024)]));
    await assert.rejects(
      b.spawn('sz', { argv: ['/bin/true'], stdin: false, env: many }).then((h) => h.wait()),
      is400,
    );
    await assert.rejects(
      b.spawn('sz', { argv: ['/bin/echo', 'a'.repeat(200 * 1024)], stdin: false }).then((h) => h.wait()),
      is400,
    );
    const ok = 'y'.repeat(60 * 1024);
    const r = await collect(await b.spawn('sz', { argv: ['/bin/sh', '-c', 'printf %s "$OK" | wc -c'], stdin: false, env: { OK: ok } }));
    assert.equal(r.stdout.trim(), String(ok.length), r.stderr);
  });
});
