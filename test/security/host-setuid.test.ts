import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { after, before, describe, test } from 'node:test';
import { missingFeature, openLab, sh, type Lab } from './support.js';

/**
 * The writable layer is an idmapped mount: sandbox root is on-disk id 0,
 * which on the host is root. A set-uid-root binary the guest makes (the
 * guest itself runs with no_new_privs, so it gains nothing from it) is,
 * on the host, a set-uid binary of host root. A host user who reaches it
 * must get nothing from it, even when the data directory is
 * world-traversable.
 */

const skip = missingFeature();

const EUID_C = `
#include <stdio.h>
#include <unistd.h>
int main(void) { printf("euid=%d\\n", (int)geteuid()); return 0; }
`;

describe(
  'security review: set-uid files of a sandbox layer on the host',
  { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 },
  () => {
    let lab: Lab;
    let probe: Buffer;
    before(async () => {
      lab = await openLab([
        { name: 'disk', storage_gb: 1, tenant: 'rev-a' },
        { name: 'nodisk', tenant: 'rev-a' },
      ]);
      probe = await lab.compile('euid', EUID_C);
    });
    after(async () => {
      await lab?.close();
    });

    for (const name of ['disk', 'nodisk']) {
      test(`${name}: a set-uid-root binary made inside gives a host user nothing`, async () => {
        const b = lab.backend;
        await b.writeGuestFile(name, '/suid', Readable.from([probe]), { mode: 0o4755 });
        const inside = await sh(b, name, 'ls -ln /suid');
        assert.match(inside.stdout, /^-rwsr-xr-x\s+\d+\s+0\s+0\s/, inside.stdout + inside.stderr);
        const upper = join(b.sandboxDir(name), name === 'disk' ? 'disk/upper' : 'upper', 'suid');
        const onHost = await stat(upper);
        assert.equal(onHost.uid, 0, 'the layer records sandbox root as on-disk id 0 (the premise of this attack)');
        assert.ok(onHost.mode & 0o4000, 'the set-uid bit is on disk');
        // Host user nobody runs it by its host path. (setpriv keeps its capabilities until its own execve,
        // so the path is walked by a shell that has none.)
        const run = spawnSync('setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', '/bin/sh', '-c', 'exec "$0"', upper], {
          encoding: 'utf8',
        });
        assert.doesNotMatch(run.stdout, /euid=0\b/, `a host user became root through the sandbox's layer: ${run.stdout}`);
      });
    }

    test("a host user reads no tenant's checkpoint archive", async () => {
      const b = lab.backend;
      const made = await sh(b, 'disk', 'echo tenant-secret-in-layer > /root/secret');
      assert.equal(made.exitCode, 0, made.stderr);
      const cp = await b.checkpoint('disk', { comment: '' });
      const archive = join(await b.checkpointDir(cp.id), 'rootfs.tar');
      assert.match(await readFile(archive, 'latin1'), /tenant-secret-in-layer/, 'the premise: the archive holds the file');
      const run = spawnSync('setpriv', ['--reuid=65534', '--regid=65534', '--clear-groups', '/bin/sh', '-c', 'cat "$0"', archive], {
        encoding: 'latin1',
      });
      assert.doesNotMatch(run.stdout, /tenant-secret-in-layer/, 'a host user read a checkpoint');
      assert.notEqual(run.status, 0);
    });

    test('with the disk nodev, deleting an image file (an overlay whiteout, a 0:0 device) still works, and survives a checkpoint', async () => {
      const b = lab.backend;
      const del = await sh(b, 'disk', 'rm /etc/inittab && test ! -e /etc/inittab && echo gone');
      assert.equal(del.stdout, 'gone\n', del.stderr);
      const cp = await b.checkpoint('disk', { comment: '' });
      await b.create({ name: 'restored', checkpointId: cp.id, cpus: 1, ram_mb: 128, storage_gb: 1, tenant: 'rev-a' });
      const r = await sh(b, 'restored', 'test ! -e /etc/inittab && echo still-gone');
      assert.equal(r.stdout, 'still-gone\n', r.stderr);
      await b.destroy('restored');
    });

    test('the host mount of a sandbox disk is nosuid and nodev', async () => {
      const mnt = join(lab.backend.sandboxDir('disk'), 'disk');
      const line = (await readFile('/proc/self/mountinfo', 'utf8')).split('\n').find((l) => l.split(' ')[4] === mnt);
      assert.ok(line, `no mount at ${mnt}`);
      const opts = line.split(' ')[5]!.split(',');
      assert.ok(opts.includes('nosuid') && opts.includes('nodev'), `mount options: ${opts.join(',')}`);
    });
  },
);
