import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { after, before, describe, test } from 'node:test';
import { collect, missingFeature, openLab, sh, type Lab } from './support.js';

/**
 * The corners of the seccomp filter the first tests leave out: the x32 ABI
 * (same audit arch as x86-64, numbers with bit 30 set), the i386 entry
 * (int 0x80: another audit arch, so the process is killed), clone with
 * CLONE_NEWUSER (not only unshare), clone3 (ENOSYS, so libc falls back to
 * a clone the filter can read), and the mount/namespace/io_uring family.
 * Also: every syscall newer than the filter's review is ENOSYS, and there is
 * no cgroup filesystem the guest could write to.
 */

const skip = missingFeature() ?? (process.arch === 'x64' ? undefined : 'x86-64 (the probe uses the x32 and i386 entries)');

const SYSCALLS_C = `
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
static void show(const char *what, long r) { printf("%s=%s\\n", what, r < 0 ? strerrorname_np(errno) : "OK"); fflush(stdout); }
int main(void) {
  show("x32_getpid", syscall(0x40000000 | SYS_getpid));
  show("clone_newuser", syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0));
  show("clone3", syscall(SYS_clone3, 0, 0));
  show("setns", syscall(SYS_setns, 0, 0));
  show("mount", syscall(SYS_mount, "none", "/tmp", "tmpfs", 0, 0));
  show("open_tree", syscall(SYS_open_tree, -100, "/", 1));
  show("fsopen", syscall(SYS_fsopen, "tmpfs", 0));
  show("io_uring_setup", syscall(SYS_io_uring_setup, 1, 0));
  show("userfaultfd", syscall(SYS_userfaultfd, 0));
  show("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0));
  show("init_module", syscall(SYS_init_module, 0, 0, ""));
  show("open_by_handle_at", syscall(SYS_open_by_handle_at, 0, 0, 0));
  show("open_tree_attr", syscall(467, -100, "/", 1, 0, 0));
  show("beyond_table", syscall(1000));
  show("mseal", syscall(462, 0, 0, 0));
  pid_t c = fork();
  if (c == 0) {
    long r;
    __asm__ volatile("int $0x80" : "=a"(r) : "a"(20) : "memory");
    _exit(r > 0 ? 0 : 3);
  }
  int st = 0;
  waitpid(c, &st, 0);
  printf("int80=%s\\n", WIFSIGNALED(st) ? strsignal(WTERMSIG(st)) : "exited");
  return 0;
}
`;

/**
 * Whether this kernel has the i386 entry at all: a plain int 0x80 getpid run
 * on the host, outside any sandbox (harmless). A kernel built or booted
 * without IA32 emulation answers int 0x80 with SIGSEGV before seccomp sees
 * it; there the guest's probe must merely not run, and where the entry
 * exists it must be the filter that kills it.
 */
const INT80_C = `
int main(void) { long r; __asm__ volatile("int $0x80" : "=a"(r) : "a"(20) : "memory"); return r > 0 ? 0 : 3; }
`;
async function hostHasI386Entry(lab: Lab): Promise<boolean> {
  const dir = mkdtempSync(join(tmpdir(), 'int80-'));
  try {
    const bin = join(dir, 'int80');
    writeFileSync(bin, await lab.compile('int80', INT80_C), { mode: 0o755 });
    const r = spawnSync(bin);
    if (r.status === 0) return true;
    assert.equal(r.signal, 'SIGSEGV', `host int 0x80 probe: status ${r.status}, signal ${r.signal}`);
    return false;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

describe('security review: seccomp corners and cgroups', { skip: skip ? `host feature missing: ${skip}` : false, timeout: 120_000 }, () => {
  let lab: Lab;
  before(async () => {
    lab = await openLab([{ name: 'sc', storage_gb: 1, tenant: 'rev-a' }]);
  });
  after(async () => {
    await lab?.close();
  });

  test('x32 and i386 entries, clone(CLONE_NEWUSER), clone3 and the mount family are refused', async () => {
    const b = lab.backend;
    await b.writeGuestFile('sc', '/syscalls', Readable.from([await lab.compile('syscalls', SYSCALLS_C)]), { mode: 0o755 });
    const r = await collect(await b.spawn('sc', { argv: ['/syscalls'], stdin: false }));
    assert.equal(r.exitCode, 0, r.stderr);
    const got = Object.fromEntries(
      r.stdout
        .trim()
        .split('\n')
        .map((l) => l.split('=') as [string, string]),
    );
    assert.equal(got.x32_getpid, 'EPERM');
    assert.equal(got.clone_newuser, 'EPERM');
    assert.equal(got.clone3, 'ENOSYS');
    for (const k of [
      'setns',
      'mount',
      'open_tree',
      'fsopen',
      'io_uring_setup',
      'userfaultfd',
      'kexec_load',
      'init_module',
      'open_by_handle_at',
    ]) {
      assert.equal(got[k], 'EPERM', `${k}: ${got[k]}`);
    }
    if (await hostHasI386Entry(lab)) {
      assert.match(got.int80 ?? '', /Bad system call/, `an i386 syscall ran: ${got.int80}`);
    } else {
      // No i386 entry on this kernel (the host's own probe got SIGSEGV): it cannot run in the guest either.
      assert.notEqual(got.int80, 'exited', 'an i386 syscall ran in the guest though the host has no i386 entry');
      assert.match(got.int80 ?? '', /Segmentation fault/, `int 0x80 in the guest: ${got.int80}`);
    }
    // Newer than the filter's review: ENOSYS, not whatever the kernel would do; the newest reviewed one still runs.
    assert.equal(got.open_tree_attr, 'ENOSYS');
    assert.equal(got.beyond_table, 'ENOSYS');
    assert.notEqual(got.mseal, 'ENOSYS', 'mseal (462, reviewed) reaches the kernel');
  });

  test('the guest sees no cgroup filesystem to write, and cannot mount one', async () => {
    const r = await sh(
      lab.backend,
      'sc',
      'ls -A /sys/fs/cgroup 2>&1 | wc -l; mkdir -p /mnt; mount -t cgroup2 none /mnt 2>&1 && echo MOUNTED; grep -c cgroup /proc/self/mounts',
    );
    const [entries, ...rest] = r.stdout.trim().split('\n');
    assert.equal(entries, '0', r.stdout);
    assert.ok(!rest.includes('MOUNTED'), r.stdout);
    assert.equal(rest.at(-1), '0', r.stdout);
  });
});
