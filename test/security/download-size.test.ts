import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { missingFeature, openLab, type Lab } from './support.js';

/**
 * A download announces the file's size first (it becomes the agent's
 * Content-Length, and what FILE_MAX_BYTES is checked against), then streams
 * the bytes. A guest that keeps growing the file must not get more bytes
 * than that onto the agent's HTTP connection: past the Content-Length they
 * are read as the start of the next response on a kept-alive connection to
 * the control plane, and the cap is bypassed.
 */

const skip = missingFeature();

describe('security review: download size', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 }, () => {
  let lab: Lab;
  before(async () => {
    lab = await openLab([{ name: 'grow', storage_gb: 1, tenant: 'rev-a' }]);
  });
  after(async () => {
    await lab?.close();
  });

  test('a download streams no more than the size it announced, however the guest grows the file meanwhile', async () => {
    const b = lab.backend;
    const writer = await b.spawn('grow', {
      argv: ['/bin/sh', '-c', 'echo start > /grow; while :; do echo 0123456789abcdef0123456789abcdef >> /grow; done'],
      stdin: false,
    });
    writer.stdout.resume();
    writer.stderr.resume();
    try {
      await new Promise((r) => setTimeout(r, 300));
      const file = await b.readGuestFile('grow', '/grow');
      let streamed = 0;
      const cut = setTimeout(() => file.stream.destroy(), 5000);
      for await (const chunk of file.stream) streamed += (chunk as Buffer).length;
      clearTimeout(cut);
      await file.done;
      assert.ok(file.size > 0);
      assert.equal(streamed, file.size, `announced ${file.size} bytes, streamed ${streamed}`);
    } finally {
      writer.kill('SIGKILL');
      await writer.wait();
    }
  });
});
