import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { assertAllowedTarget, guardedLookup, isForbiddenAddress } from '../../src/adapters/webhooks/target-guard.js';
import { signatureHeader, verifySignature } from '../../src/adapters/webhooks/signature.js';

/** Where a tenant's webhook may point, address by address, and the delivery-time lookup that enforces it. */

describe('webhook targets', () => {
  test('loopback, private, link-local, CGNAT, reserved and IPv4-mapped forms are forbidden; public ones are not', () => {
    for (const a of [
      '127.0.0.1',
      '127.255.0.9',
      '10.0.0.1',
      '172.16.5.5',
      '172.31.255.255',
      '192.168.1.1',
      '169.254.169.254',
      '100.64.0.1',
      '0.0.0.0',
      '224.0.0.1',
      '255.255.255.255',
      '::1',
      '::',
      'fd00::1',
      'fe80::1',
      '::ffff:127.0.0.1',
      '::ffff:169.254.169.254',
      'not-an-address',
    ])
      assert.equal(isForbiddenAddress(a), true, a);
    for (const a of ['198.51.100.7', '203.0.113.9', '8.8.8.8', '172.32.0.1', '2001:db8::1']) assert.equal(isForbiddenAddress(a), false, a);
  });

  test('a name is judged by what it resolves to, at creation', async () => {
    await assert.rejects(assertAllowedTarget('http://localhost:8080/x', false), { code: 'WEBHOOK_TARGET_FORBIDDEN' });
    await assert.rejects(assertAllowedTarget('http://user:pw@203.0.113.9/', false), { code: 'WEBHOOK_TARGET_FORBIDDEN' });
    await assert.rejects(assertAllowedTarget('gopher://203.0.113.9/', false), { code: 'WEBHOOK_TARGET_FORBIDDEN' });
    assert.equal((await assertAllowedTarget('http://203.0.113.9/hook', false)).host, '203.0.113.9');
    assert.equal((await assertAllowedTarget('http://localhost:8080/x', true)).hostname, 'localhost');
  });

  test('the delivery-time lookup refuses a name that resolves to a forbidden address, unless allowed', async () => {
    const look = (allow: boolean) =>
      new Promise<{ err: NodeJS.ErrnoException | null; address: unknown }>((resolve) =>
        guardedLookup(allow)('localhost', {}, (err, address) => resolve({ err, address })),
      );
    const refused = await look(false);
    assert.equal(refused.err?.code, 'WEBHOOK_TARGET_FORBIDDEN');
    const allowed = await look(true);
    assert.equal(allowed.err, null);
    assert.ok(isForbiddenAddress(String(allowed.address)));
  });

  test('signatures verify for the body and secret they were made with, within the tolerance', () => {
    const body = '{"event":"vm.booted"}';
    const h = signatureHeader('whsec_x', body, 1_000_000);
    assert.equal(verifySignature('whsec_x', body, h, 300, 1_000_100), true);
    assert.equal(verifySignature('whsec_x', `${body} `, h, 300, 1_000_100), false);
    assert.equal(verifySignature('whsec_y', body, h, 300, 1_000_100), false);
    assert.equal(verifySignature('whsec_x', body, h, 300, 1_000_400), false, 'too old: a replay');
  });
});
