import { access, chmod, copyFile, mkdir, mkdtemp, readdir, readFile, rename, rm, stat, symlink, writeFile } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { NotFoundError } from '@fleet/agent-protocol';
import { BackendErrorCode, featureMissing } from '../../backend.js';
import { validateImageName } from '../../images.js';
import { mustRun, runTool } from '../process/exec-util.js';

/**
 * VM images for the qemu backend, built from Debian packages on the host:
 * the host's Debian kernel (`linux-image-amd64`), an initramfs holding the
 * few modules the guest needs to reach its root disk (virtio, ext4), and an
 * ext4 root with the host's static busybox, `resize2fs` and the in-guest
 * agent (compiled static here). Each VM boots a qcow2 overlay over the
 * read-only `rootfs.qcow2`.
 *
 * Layout: `<imageDir>/.qemu/<name>/{vmlinuz, initrd.img, rootfs.qcow2, image.json}`
 * (the leading dot keeps it out of the process backend's image list).
 */

export const GUEST_AGENT_PORT = 7071;
/** The guest's own view: where the seed disk is unpacked (a tmpfs, never on the VM's disk). */
export const GUEST_SEED_DIR = '/run/fleet';
const ROOT_SIZE_MB = 512;

/** Loaded in this order by the initramfs; their dependencies are added from modules.dep. */
const GUEST_MODULES = ['crc32c_generic', 'virtio_pci', 'virtio_blk', 'virtio_net', 'ext4', 'evdev', 'button'];

export interface QemuImage {
  readonly name: string;
  readonly dir: string;
  readonly kernel: string;
  readonly initrd: string;
  readonly rootfs: string;
  readonly kernelVersion: string;
  readonly rootBytes: number;
  /** QEMU_IMAGE_FORMAT it was built with (1: before memory restores). */
  readonly format: number;
}

export const qemuImageRoot = (imageDir: string): string => join(imageDir, '.qemu');

export async function resolveQemuImage(imageDir: string, name: string): Promise<QemuImage> {
  validateImageName(name);
  const dir = join(qemuImageRoot(imageDir), name);
  let meta: { kernel_version: string; root_bytes: number; format?: number };
  try {
    meta = JSON.parse(await readFile(join(dir, 'image.json'), 'utf8')) as { kernel_version: string; root_bytes: number; format?: number };
  } catch {
    throw new NotFoundError(
      BackendErrorCode.ImageNotFound,
      `VM image "${name}" is not on this host; build it with \`npm run agent -- image build ${name} --backend qemu\``,
      { image: name },
    );
  }
  return {
    name,
    dir,
    kernel: join(dir, 'vmlinuz'),
    initrd: join(dir, 'initrd.img'),
    rootfs: join(dir, 'rootfs.qcow2'),
    kernelVersion: meta.kernel_version,
    rootBytes: meta.root_bytes,
    format: meta.format ?? 1,
  };
}

export interface BuildQemuImageOptions {
  readonly force?: boolean;
  /** Kernel release under /boot and /lib/modules; default the newest installed. */
  readonly kernelVersion?: string;
  readonly busybox?: string;
}

async function exists(p: string): Promise<boolean> {
  return access(p).then(
    () => true,
    () => false,
  );
}

async function newestKernel(): Promise<string> {
  const names = (await readdir('/boot').catch(() => [] as string[])).filter((n) => /^vmlinuz-/.test(n));
  const versions = [];
  for (const n of names) {
    const v = n.slice('vmlinuz-'.length);
    if (await exists(join('/lib/modules', v, 'modules.dep'))) versions.push(v);
  }
  versions.sort((a, b) => a.localeCompare(b, 'en', { numeric: true }));
  const v = versions.at(-1);
  if (!v) throw featureMissing('guest kernel', 'no /boot/vmlinuz-* with its modules: run `apt-get install linux-image-amd64`');
  return v;
}

/** The modules to load, dependencies first, as paths relative to /lib/modules/<v>. */
export function moduleClosure(modulesDep: string, wanted: readonly string[]): string[] {
  const deps = new Map<string, string[]>();
  const byName = new Map<string, string>();
  for (const line of modulesDep.split('\n')) {
    const [mod, rest] = line.split(':');
    if (!mod || rest === undefined) continue;
    deps.set(mod, rest.trim().split(/\s+/).filter(Boolean));
    byName.set(
      basename(mod)
        .replace(/\.ko(\.\w+)?$/, '')
        .replaceAll('-', '_'),
      mod,
    );
  }
  const out: string[] = [];
  const visit = (mod: string): void => {
    if (out.includes(mod)) return;
    for (const d of deps.get(mod) ?? []) visit(d);
    out.push(mod);
  };
  for (const w of wanted) {
    const mod = byName.get(w);
    // Built into this kernel (no .ko): nothing to load.
    if (mod) visit(mod);
  }
  return out;
}

/** The shared libraries a dynamic host binary needs (from ldd), interpreter included. */
async function sharedLibs(binary: string): Promise<string[]> {
  const out = await mustRun('ldd', [binary]);
  const libs: string[] = [];
  for (const line of out.split('\n')) {
    const m = /(?:=>\s*)?(\/\S+)\s+\(0x/.exec(line);
    if (m?.[1]) libs.push(m[1]);
  }
  return libs;
}

async function copyWithLibs(root: string, binary: string, dest: string): Promise<void> {
  await mkdir(dirname(join(root, dest)), { recursive: true });
  await copyFile(binary, join(root, dest));
  for (const lib of await sharedLibs(binary)) {
    await mkdir(dirname(join(root, lib)), { recursive: true });
    await copyFile(lib, join(root, lib));
  }
}

async function installBusybox(root: string, busybox: string): Promise<void> {
  await mkdir(join(root, 'bin'), { recursive: true });
  await copyFile(busybox, join(root, 'bin/busybox'));
  await chmod(join(root, 'bin/busybox'), 0o755);
  const applets = (await mustRun(busybox, ['--list-full'])).split('\n').filter(Boolean);
  for (const rel of applets) {
    if (rel === 'bin/busybox') continue;
    const target = join(root, rel);
    if (await exists(target)) continue;
    await mkdir(dirname(target), { recursive: true });
    await symlink('/bin/busybox', target);
  }
}

export async function compileGuestAgent(outPath: string): Promise<void> {
  const src = fileURLToPath(new URL('./guest/fleet-guest-agent.c', import.meta.url));
  const res = await runTool('gcc', ['-O2', '-static', '-Wall', '-o', outPath, src, '-lutil'], { timeoutMs: 120_000 }).catch(() => null);
  if (!res || res.code !== 0) {
    throw featureMissing(
      'gcc',
      `the in-guest agent is compiled on the host (apt-get install gcc libc6-dev)${res ? `: ${res.stderr.trim().slice(0, 300)}` : ''}`,
    );
  }
}

const INIT = (modules: readonly string[]) => `#!/bin/sh
# initramfs: load the modules the root disk needs, unpack the seed into a tmpfs, switch to the root disk.
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
${modules.map((m) => `insmod /lib/modules/${basename(m)}`).join('\n')}
i=0
while [ ! -b /dev/vda ] || [ ! -b /dev/vdb ]; do
  i=$((i+1)); [ $i -gt 300 ] && { echo "fleet: no root disk"; poweroff -f; }
  sleep 0.1
done
mkdir -p /newroot
mount -t ext4 -o rw /dev/vda /newroot || { echo "fleet: cannot mount root"; poweroff -f; }
mount -t tmpfs -o mode=0755,nosuid,nodev run /newroot/run
mkdir -m 0700 /newroot${GUEST_SEED_DIR}
tar -xf /dev/vdb -C /newroot${GUEST_SEED_DIR} || { echo "fleet: bad seed"; poweroff -f; }
/sbin/resize2fs /dev/vda >/dev/null 2>&1
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /sbin/init
`;

// The seed (unpacked at /run/fleet by the initramfs): net.env, token, env, files/ (startup files laid over /).
const RCS = `#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /tmp
. ${GUEST_SEED_DIR}/net.env
hostname "$FLEET_HOSTNAME"
echo "$FLEET_HOSTNAME" > /etc/hostname
ip link set lo up
ip link set eth0 address "$FLEET_MAC"
ip addr add "$FLEET_IP/$FLEET_PREFIX" dev eth0
ip link set eth0 up
ip route add "$FLEET_GATEWAY" dev eth0
ip route add default via "$FLEET_GATEWAY" dev eth0
[ -d ${GUEST_SEED_DIR}/files ] && cp -a ${GUEST_SEED_DIR}/files/. /
acpid
echo "fleet: guest up at $FLEET_IP"
`;

/**
 * The host's control channel on the second serial port (a unix socket only
 * the agent reaches). After a memory restore the guest still holds the
 * identity it was captured under; the host sends the one it has now (a
 * fork's address, MAC, name and token; the time) and waits for "ok <nonce>".
 */
const CONTROL = `#!/bin/sh
stty -F /dev/ttyS1 raw -echo 2>/dev/null
exec </dev/ttyS1 >/dev/ttyS1 2>/dev/null
while read -r verb nonce ip prefix gw mac name token epoch; do
  [ "$verb" = identity ] || continue
  date -s "@$epoch" >/dev/null
  if [ "$(cat /sys/class/net/eth0/address)" != "$mac" ] || ! ip -o -4 addr show dev eth0 | grep -q " $ip/$prefix "; then
    ip link set eth0 down
    ip addr flush dev eth0
    ip link set eth0 address "$mac"
    ip addr add "$ip/$prefix" dev eth0
    ip link set eth0 up
    ip route replace "$gw" dev eth0
    ip route replace default via "$gw" dev eth0
  fi
  hostname "$name"
  echo "$name" > /etc/hostname
  umask 077
  printf '%s' "$token" > ${GUEST_SEED_DIR}/token.new && mv ${GUEST_SEED_DIR}/token.new ${GUEST_SEED_DIR}/token
  printf 'FLEET_HOSTNAME=%s\\nFLEET_IP=%s\\nFLEET_PREFIX=%s\\nFLEET_GATEWAY=%s\\nFLEET_MAC=%s\\n' "$name" "$ip" "$prefix" "$gw" "$mac" > ${GUEST_SEED_DIR}/net.env
  arping -U -c 1 -I eth0 "$ip" >/dev/null 2>&1 &
  echo "ok $nonce"
done
`;

/** Bumped when a VM needs something of its image that older builds lack (2: the control channel, memory restores). */
export const QEMU_IMAGE_FORMAT = 2;

const INITTAB = `::sysinit:/etc/init.d/rcS
::respawn:/usr/sbin/fleet-guest-agent ${GUEST_AGENT_PORT} ${GUEST_SEED_DIR}/token
::respawn:/usr/sbin/fleet-control
::shutdown:/bin/sh -c 'kill -TERM -1; sleep 1; sync; umount -a -r'
`;

/**
 * Builds `<imageDir>/.qemu/<name>/` into a temporary sibling and renames it
 * into place; an existing image is kept unless `force`.
 */
export async function buildQemuImage(imageDir: string, name: string, opts: BuildQemuImageOptions = {}): Promise<QemuImage> {
  validateImageName(name);
  const root = qemuImageRoot(imageDir);
  const dest = join(root, name);
  if (!opts.force && (await exists(join(dest, 'image.json')))) {
    const have = await resolveQemuImage(imageDir, name);
    // An image from an older build lacks what VMs now need of it: rebuilt, not reused.
    if (have.format >= QEMU_IMAGE_FORMAT) return have;
  }
  const busybox = opts.busybox ?? '/bin/busybox';
  if (!(await exists(busybox))) throw featureMissing('busybox', `${busybox} is absent: run \`apt-get install busybox-static\``);
  for (const tool of ['qemu-img', 'mke2fs', 'cpio', 'resize2fs']) {
    const found = await runTool('sh', ['-c', `command -v ${tool}`]).catch(() => null);
    if (!found || found.code !== 0) throw featureMissing(tool, `apt-get install qemu-utils e2fsprogs cpio`);
  }
  const version = opts.kernelVersion ?? (await newestKernel());
  const kernel = join('/boot', `vmlinuz-${version}`);
  if (!(await exists(kernel))) throw featureMissing('guest kernel', `${kernel} is absent: run \`apt-get install linux-image-amd64\``);

  await mkdir(root, { recursive: true });
  const work = await mkdtemp(join(root, `.build-${name}-`));
  try {
    const out = join(work, 'image');
    await mkdir(out);
    await copyFile(kernel, join(out, 'vmlinuz'));
    const resize2fs = (await mustRun('sh', ['-c', 'command -v resize2fs'])).trim();

    // initramfs
    const ird = join(work, 'initramfs');
    await installBusybox(ird, busybox);
    for (const d of ['proc', 'sys', 'dev', 'newroot', 'run', 'lib/modules']) await mkdir(join(ird, d), { recursive: true });
    const modDir = join('/lib/modules', version);
    const modules = moduleClosure(await readFile(join(modDir, 'modules.dep'), 'utf8'), GUEST_MODULES);
    for (const m of modules) await copyFile(join(modDir, m), join(ird, 'lib/modules', basename(m)));
    await copyWithLibs(ird, resize2fs, 'sbin/resize2fs');
    await writeFile(join(ird, 'init'), INIT(modules), { mode: 0o755 });
    await mustRun('sh', ['-c', `cd "${ird}" && find . | cpio -o -H newc --quiet | gzip -1 > "${join(out, 'initrd.img')}"`], {
      timeoutMs: 120_000,
    });

    // root filesystem
    const rfs = join(work, 'root');
    await installBusybox(rfs, busybox);
    for (const d of ['proc', 'sys', 'dev', 'run', 'tmp', 'root', 'home', 'var/log', 'etc/init.d', 'usr/sbin', 'etc/acpi/PWRF', 'mnt']) {
      await mkdir(join(rfs, d), { recursive: true });
    }
    await chmod(join(rfs, 'tmp'), 0o1777);
    await copyWithLibs(rfs, resize2fs, 'sbin/resize2fs');
    await compileGuestAgent(join(rfs, 'usr/sbin/fleet-guest-agent'));
    await writeFile(join(rfs, 'etc/init.d/rcS'), RCS, { mode: 0o755 });
    await writeFile(join(rfs, 'etc/inittab'), INITTAB);
    await writeFile(join(rfs, 'usr/sbin/fleet-control'), CONTROL, { mode: 0o755 });
    // busybox acpid runs /etc/acpi/PWRF/00000080 on the power button QEMU's system_powerdown presses.
    await writeFile(join(rfs, 'etc/acpi/PWRF/00000080'), '#!/bin/sh\npoweroff\n', { mode: 0o755 });
    await writeFile(join(rfs, 'etc/passwd'), 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n');
    await writeFile(join(rfs, 'etc/group'), 'root:x:0:\ntty:x:5:\nnogroup:x:65534:\n');
    await writeFile(join(rfs, 'etc/profile'), 'export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n');
    const ext4 = join(work, 'rootfs.ext4');
    await mustRun('mke2fs', ['-q', '-t', 'ext4', '-L', 'fleet-root', '-E', 'root_owner=0:0', '-d', rfs, ext4, `${ROOT_SIZE_MB}M`], {
      timeoutMs: 120_000,
    });
    await mustRun('qemu-img', ['convert', '-q', '-f', 'raw', '-O', 'qcow2', ext4, join(out, 'rootfs.qcow2')], { timeoutMs: 300_000 });
    await chmod(join(out, 'rootfs.qcow2'), 0o444);
    await writeFile(
      join(out, 'image.json'),
      `${JSON.stringify({ name, format: QEMU_IMAGE_FORMAT, kernel_version: version, root_bytes: ROOT_SIZE_MB * 1024 * 1024, built_at: new Date().toISOString() })}\n`,
    );
    if (await exists(dest)) await rm(dest, { recursive: true, force: true });
    await rename(out, dest);
  } finally {
    await rm(work, { recursive: true, force: true });
  }
  return resolveQemuImage(imageDir, name);
}

export async function listQemuImages(imageDir: string): Promise<string[]> {
  const names = await readdir(qemuImageRoot(imageDir)).catch(() => [] as string[]);
  const out: string[] = [];
  for (const n of names.sort())
    if (!n.startsWith('.') && (await stat(join(qemuImageRoot(imageDir), n, 'image.json')).catch(() => null))) out.push(n);
  return out;
}
