#!/usr/bin/env bash
# Builds the CRIU the agent's memory checkpoints use and prints its path on the last line (CI: CRIU_PATH=$(... | tail -1)).
#   CRIU 4.1.1 (the shared vendored tarball, as ../shared/tools/build-criu.sh builds it) plus four patches:
#   criu-4.1.1-sockopt-6.16.patch. Linux 6.16 answers EOPNOTSUPP to SO_PASSCRED/SO_PASSSEC on inet sockets, and 4.1.1
#   then refuses to dump any TCP socket (upstream criu issue #2718): a sandbox with a listening server could not be
#   checkpointed at all.
#   criu-4.1.1-uffd-dev.patch. A lazy restore has each restored task open its own userfaultfd, inside the sandbox's
#   user namespace, which vm.unprivileged_userfaultfd=0 refuses (EPERM). criu (root) opens /dev/userfaultfd (Linux 6.1)
#   before it builds the tree and the tasks ask that for their uffd, closing it before the restorer hands over; the
#   sysctl stays 0 and the sandbox never holds the device. (UFFD_USER_MODE_ONLY is no way out: kernel-mode accesses
#   to a missing page then fail with EFAULT, and the restorer's own rseq registration already does.)
#   criu-4.1.1-lazy-pipe-size.patch. The lazy page server sizes its tee pipe past fs.pipe-max-size, which needs
#   CAP_SYS_RESOURCE (these hosts run without it): EPERM, ignored, and every page request then failed (splice EBADF,
#   the target saw "connection reset"). It now falls back to pipe-max-size, which the page pipes it reads never exceed.
#   criu-4.1.1-zombie-reparent.patch. A zombie of a dead session leader's session is restored under a helper and must
#   then be reparented to its real parent (often the init), which waits for it; 4.1.1 waits for that by waiting for
#   the stage's count of tasks to change, which never happens when every other task finished the stage first: the
#   restore hung for good (a fork right after an envd command ended, about one in two). It polls for the reparenting.
#   Installed to $CRIU_PREFIX (default /opt/criu-4.1.1-fleet), apart from an unpatched build.
# Needs root for apt-get (Debian 12 build dependencies). Idempotent.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=${CRIU_PREFIX:-/opt/criu-4.1.1-fleet}
patches=("$here/criu-4.1.1-sockopt-6.16.patch" "$here/criu-4.1.1-uffd-dev.patch" "$here/criu-4.1.1-lazy-pipe-size.patch"
  "$here/criu-4.1.1-zombie-reparent.patch")
stamp="$prefix/patch.sha256"
want=$(cat "${patches[@]}" | sha256sum | cut -d' ' -f1)
if [ -x "$prefix/sbin/criu" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$prefix/sbin/criu" check >/dev/null 2>&1; then
  echo "$prefix/sbin/criu"; exit 0
fi
vendor=${CRIU_VENDOR_DIR:-$here/../../../shared/vendor/criu}
[ -d "$vendor" ] || vendor=/work/shared/vendor/criu
tarball="$vendor/criu_4.1.1.orig.tar.xz"
[ -f "$tarball" ] || { echo "criu build: $tarball is missing (set CRIU_VENDOR_DIR)" >&2; exit 1; }
(cd "$vendor" && sha256sum -c --quiet SHA256SUMS) || { echo "criu build: checksum mismatch" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
deps="build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev iproute2 patch"
if ! dpkg -s $deps >/dev/null 2>&1; then
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends $deps >&2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xf "$tarball" -C "$work"
for p in "${patches[@]}"; do patch -d "$work/criu-4.1.1" -p1 < "$p" >&2; done
make -C "$work/criu-4.1.1" -j"$(nproc)" criu >&2
install -D -m 0755 "$work/criu-4.1.1/criu/criu" "$prefix/sbin/criu"
echo "$want" > "$stamp"
"$prefix/sbin/criu" check >/dev/null 2>&1 || { echo "criu build: the built criu fails 'criu check' on this kernel:" >&2; "$prefix/sbin/criu" check >&2 || true; exit 1; }
echo "$prefix/sbin/criu"
