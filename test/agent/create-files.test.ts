import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it, type TestContext } from 'node:test';
import { AppError } from '@fleet/agent-protocol';
import { featureSkip, missingPrerequisite, prepareImages, startAgent, uniquePrefix, uniqueSubnet, type RunningAgent } from './harness.js';

const b64 = (s: string): string => Buffer.from(s).toString('base64');

/**
 * A create that carries its guest files (the control plane's token and the
 * caller's files): written before the create answers, parents made, modes
 * kept; a file that cannot be written fails the create and leaves no sandbox.
 */
describe('host agent: files written by the create call', { timeout: 180_000 }, () => {
  let skip: string | undefined;
  let agent: RunningAgent | undefined;
  const dirs: string[] = [];
  const guard = (t: TestContext): boolean => {
    if (skip) t.skip(skip);
    return !!skip;
  };

  before(async () => {
    skip = await missingPrerequisite();
    if (skip) return;
    const images = await prepareImages();
    if ('skip' in images) {
      skip = images.skip;
      return;
    }
    dirs.push(images.imageDir);
    const dataDir = await mkdtemp(join(tmpdir(), 'agent-cf-'));
    dirs.push(dataDir);
    try {
      agent = await startAgent({ dataDir, imageDir: images.imageDir, subnet: uniqueSubnet(), bridgePrefix: uniquePrefix() });
      await agent.client.createVm({ name: 'cf-probe', image: 'base' });
      await agent.client.destroyVm('cf-probe', { force: true });
    } catch (err) {
      skip = featureSkip(err);
      if (!skip) throw err;
    }
  });

  after(async () => {
    if (agent) {
      for (const vm of await agent.client.listVms('').catch(() => []))
        await agent.client.destroyVm(vm.name, { force: true }).catch(() => {});
      await agent.stop();
      await agent.cleanupHost();
    }
    for (const d of dirs) await rm(d, { recursive: true, force: true }).catch(() => {});
  });

  it('writes every file before it answers, in new directories, with its mode', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    const info = await c.createVm({
      name: 'cf1',
      image: 'base',
      files: [
        { path: '/etc/fleet/token', content_b64: b64('s3cret'), mode: '600' },
        { path: '/work/deep/dir/data.txt', content_b64: b64('hello\n') },
      ],
    });
    assert.equal(info.files_written, 2);
    const r = await c.exec('cf1', {
      argv: [
        'sh',
        '-c',
        'cat /etc/fleet/token; echo; stat -c %a /etc/fleet/token; cat /work/deep/dir/data.txt; stat -c %a /work/deep/dir/data.txt; stat -c "%a %u %g" /work /work/deep/dir /etc',
      ],
    });
    assert.equal(r.exit_code, 0, r.stderr);
    // The new directories are made as `mkdir -p` by the guest's root would (umask 022); /etc, already there, is untouched.
    assert.equal(r.stdout, 's3cret\n600\nhello\n644\n755 0 0\n755 0 0\n755 0 0\n');
  });

  it('fails the create and removes the sandbox when a file cannot be written', async (t) => {
    if (guard(t)) return;
    const c = agent!.client;
    await assert.rejects(
      c.createVm({
        name: 'cf2',
        image: 'base',
        // A directory in the image cannot be replaced by a file.
        files: [{ path: '/etc', content_b64: b64('x') }],
      }),
      (err: unknown) => err instanceof AppError,
    );
    assert.deepEqual(
      (await c.listVms('cf2')).map((v) => v.name),
      [],
      'no half-made sandbox is left',
    );
  });

  it('refuses a relative path or content that is not base64 before making anything', async (t) => {
    if (guard(t)) return;
    const res = await fetch(`${agent!.url}/v1/vms`, {
      method: 'POST',
      headers: { authorization: `Bearer ${agent!.token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ name: 'cf3', image: 'base', files: [{ path: 'etc/x', content_b64: b64('x') }] }),
    });
    assert.equal(res.status, 400);
    const bad = await fetch(`${agent!.url}/v1/vms`, {
      method: 'POST',
      headers: { authorization: `Bearer ${agent!.token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ name: 'cf3', image: 'base', files: [{ path: '/x', content_b64: '%%%' }] }),
    });
    assert.equal(bad.status, 400);
    assert.deepEqual(await agent!.client.listVms('cf3'), []);
  });
});
