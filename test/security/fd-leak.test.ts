import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { after, before, describe, test } from 'node:test';
import type { EnterOp } from '../../packages/agent/src/backend/process/launch.js';
import { missingFeature, openLab, sh, type Lab } from './support.js';

/**
 * libuv's spawn hands a child its stdio and leaves every other descriptor
 * the agent inherited without O_CLOEXEC open across exec (a service
 * manager's socket, a parent's pipe, a shell's `3>file`; under the test
 * runner, a pipe at fd 251). Through the helper, such a descriptor reached
 * every guest exec: a host pipe or file a tenant could write to, or a host
 * directory it could fchdir out of its root through. The helper's child
 * closes everything past stdio before the guest runs.
 */

const skip = missingFeature();

describe('security review: descriptors into the guest', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 }, () => {
  let lab: Lab;
  before(async () => {
    lab = await openLab([{ name: 'fd', storage_gb: 1, tenant: 'rev-a' }]);
  });
  after(async () => {
    await lab?.close();
  });

  test('a descriptor the host side holds open past stdio does not reach the guest', async () => {
    // The helper's argv for an exec, as the backend builds it; started with a host pipe as fd 3.
    const enter = (lab.backend as unknown as { enter(r: unknown, op: EnterOp): Promise<string[]>; must(n: string): unknown }).enter.bind(
      lab.backend,
    );
    const record = (lab.backend as unknown as { must(n: string): unknown }).must('fd');
    const argv = await enter(record, { op: 'exec', argv: ['/bin/sh', '-c', 'sleep 5 & ls /proc/$!/fd; kill $!'] });
    const child = spawn(argv[0]!, argv.slice(1), { stdio: ['ignore', 'pipe', 'pipe', 'pipe'], env: {} });
    let out = '';
    let err = '';
    child.stdout!.setEncoding('utf8').on('data', (d: string) => (out += d));
    child.stderr!.setEncoding('utf8').on('data', (d: string) => (err += d));
    const code = await new Promise<number | null>((resolve) => child.once('close', resolve));
    assert.equal(code, 0, err);
    assert.deepEqual(out.trim().split(/\s+/), ['0', '1', '2'], `a guest process holds descriptors ${out.trim()}`);
  });

  test('and through the backend, for a piped exec', async () => {
    const r = await sh(lab.backend, 'fd', 'sleep 5 & ls /proc/$!/fd; kill $!');
    assert.deepEqual(r.stdout.trim().split(/\s+/), ['0', '1', '2'], r.stdout);
  });
});
