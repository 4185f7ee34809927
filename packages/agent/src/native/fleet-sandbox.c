/*
 * fleet-sandbox: the only host-side program between the agent and a guest.
 *
 * Built static (no ld.so, so no LD_* variable is ever honoured) by the agent
 * at open (packages/agent/src/native/helper.ts) and always started with a fixed
 * environment. The guest's environment travels in FLEET_E<n>=<hex of K=V>
 * variables that nothing on the host interprets; it becomes `environ` only
 * after the process is inside the sandbox, confined, right before execve.
 *
 *   fleet-sandbox start N CGROUP_PROCS_FILE×N STATUS ROOT HOSTNAME ADDR/LEN GATEWAY NETRAW(0|1) EMPTYDIR
 *       A sandbox's start from the host side, in one process (cmd_start):
 *       joins the cgroups, opens STATUS, unshares the namespaces, forks the
 *       init and stays as its reaper. The agent writes the id maps and
 *       mounts ROOT (mount-root) once this process's network namespace is
 *       new. The init waits until the ids are mapped and ROOT is mounted,
 *       becomes root of the namespace and does stage 2 in ROOT: proc,
 *       sysfs, /dev, devpts, hostname, lo, waits for eth0 and configures it
 *       (rtnetlink), then boots: masks /proc and /sys paths (a directory
 *       with a read-only bind of EMPTYDIR, an empty directory of host
 *       root's), pivot_root,
 *       detaches the old root, confines itself, writes "ready" on fd 3 (the
 *       agent's pipe) and execs /sbin/init.
 *       The reaper, in the sandbox's namespaces but the host's pid one, is
 *       the one process that learns how the init ended. STATUS is opened by
 *       the host side before the user namespace (its directory is closed
 *       from inside): one record, rewritten in place, "<init host pid>
 *       <start ticks> running", then "... exited <code>" or "... signaled
 *       <signo>". Detached like the init, it outlives the agent, which reads
 *       the record after a restart.
 *   fleet-sandbox mount-root PID HOSTID IMAGE LAYERDIR ROOT
 *       Host side of a start, once PID (in the sandbox's new user and mount
 *       namespaces) has its id maps: IMAGE and LAYERDIR (holding upper/ and
 *       work/) are cloned as idmapped mounts (on-disk id N <-> sandbox id N,
 *       so a layer never records this host's id range), and the overlay of
 *       them is mounted at ROOT inside PID's mount namespace, by host root,
 *       with the usual trusted.overlay xattrs. HOSTID is the host id of the
 *       sandbox's root: the overlay writes its work files as the mounter's
 *       fsuid, which must have a mapping in the idmapped upper layer.
 *       PID 0 (a restore's root, mounted in the agent's namespace for CRIU):
 *       the ids are mapped by a user namespace of no process's, 0..65535 to
 *       HOSTID.., made here, and ROOT is mounted in this process's mount
 *       namespace.
 *   fleet-sandbox enter PID [--start TICKS] [--cg FILE]... [--cwd DIR] [--net-raw]
 *                       [--winsize ROWS COLS] -- OP ARGS...
 *       Join the cgroup(s), enter the namespaces (user first) and root of
 *       the init PID, fork into its pid namespace, confine, then OP:
 *         exec ARGV...         execvp with the guest's PATH, inside the root
 *         put PATH MODE TMP [parents]
 *                              stdin -> TMP, chmod, rename to PATH (exit 21: PATH is a directory);
 *                              `parents`: PATH's missing directories are made first (mkdir -p)
 *         get PATH             "<size>\n" then the bytes (exit 21: not a regular file)
 *         unlink PATH
 *       The host-side parent waits and exits with the child's status (a
 *       fatal signal is re-raised), so a caller sees the guest's status.
 *   fleet-sandbox (no argument, CRTOOLS_SCRIPT_ACTION set)
 *       CRIU's action script at a restore (criu.ts restoreTree; cmd_criu_hook): at setup-namespaces, the restored
 *       tree's empty network namespace gets its eth0 (the veth, its address and routes over rtnetlink; the ping
 *       range);
 *       at post-restore, before any restored task runs, the hostname is set and the masked directories (binds of EMPTYDIR, which CRIU
 *       restores as external mounts without their flags) are made read-only, nosuid, nodev and noexec again; at
 *       post-resume, the agent's mount of the root for CRIU is detached. Its environment is the one the agent
 *       gives criu (criu-lazy.ts CRIU_ENV and the FLEET_* values of the restore), with CRIU's own CRTOOLS_*.
 *   fleet-sandbox serve SOCKET [--allow TOOL]...
 *       The agent's long-lived spawner, so an exec costs a fork of this small
 *       process instead of a fork of Node plus an execve: listens on SOCKET
 *       (a path in the agent's 0700 data directory, made 0600), accepts only
 *       connections from uid 0, and per connection forks a relay that runs
 *       one of three things with the request's arguments, over pipes it
 *       relays as frames:
 *         enter ARGS...        the helper's `enter`, with the FLEET_E<n>
 *                              environment of the request (a guest exec);
 *         mount-root ARGS...   the helper's `mount-root` (a sandbox start);
 *         run TOOL ARGS...     execve of TOOL, an absolute path given by an
 *                              --allow at the serve's start (the agent's
 *                              host tools: ip, nft, mount…), with only
 *                              PATH=/usr/sbin:/usr/bin:/sbin:/bin;
 *       nothing else (no start, serve, no other program). Only
 *       host root can connect, and host root could run these tools anyway:
 *       the list keeps a request (a bug in the agent) from naming another
 *       program; it is not a boundary against root. The
 *       protocol (all integers little-endian):
 *         agent -> relay: u32 length, then u32 nargs, u32 nenv and that many
 *           NUL-terminated strings (the verb and its args, then FLEET_E<n>=hex,
 *           enter only);
 *           then the guest's raw stdin; a half-close is its end of input.
 *         relay -> agent: frames of u8 type, u32 length, payload: 'P' u32
 *           the relay's pid (its process group: the agent signals it as it
 *           signals a spawned helper), 'O' stdout bytes, 'R' stderr bytes,
 *           'X' i32 exit code (-1 when signalled), i32 signal number.
 *       The relay stays until the agent closes its side, so the process
 *       group the agent may still signal is never a reused pid; if the
 *       agent vanishes (hang-up), the relay kills its group.
 *
 * Confinement, in this order: capability bounding set and capsets reduced
 * to Docker's default set minus MKNOD, SYS_CHROOT and (unless --net-raw)
 * NET_RAW, ambient cleared; PR_SET_NO_NEW_PRIVS; a seccomp filter.
 * Exit 125: the helper itself failed (message on stderr).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/securebits.h>
#include <sys/fsuid.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#ifndef CLONE_NEWUSER
#define CLONE_NEWUSER 0x10000000
#endif
#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif

extern char **environ;

static void fail(const char *what, const char *arg) {
  int e = errno;
  dprintf(2, "fleet-sandbox: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(e));
  _exit(125);
}

static void usage(void) {
  dprintf(2, "fleet-sandbox: bad usage (see the header of fleet-sandbox.c)\n");
  _exit(125);
}

/* ---- confinement ---- */

static const int GUEST_CAPS[] = {
    CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL, CAP_SETGID, CAP_SETUID,
    CAP_SETPCAP, CAP_NET_BIND_SERVICE, CAP_AUDIT_WRITE, CAP_SETFCAP,
};

static void drop_caps(int net_raw) {
  unsigned long long keep = 0;
  for (size_t i = 0; i < sizeof GUEST_CAPS / sizeof GUEST_CAPS[0]; i++) keep |= 1ULL << GUEST_CAPS[i];
  if (net_raw) keep |= 1ULL << CAP_NET_RAW;
  for (int c = 0; c <= 63; c++) {
    if (keep & (1ULL << c)) continue;
    if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL) fail("drop capability from the bounding set", NULL);
  }
  if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) fail("clear ambient capabilities", NULL);
  struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2];
  memset(data, 0, sizeof data);
  data[0].effective = data[0].permitted = (unsigned)(keep & 0xffffffffu);
  data[1].effective = data[1].permitted = (unsigned)(keep >> 32);
  if (syscall(SYS_capset, &hdr, data) < 0) fail("capset", NULL);
}

#define DENY(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM)

/*
 * Modelled on the default profile of Docker/containerd: what a container
 * without CAP_SYS_ADMIN & co. is refused, here as a deny list (EPERM) so
 * an unknown new syscall is not a crash. clone3 answers ENOSYS (its flags
 * sit behind a pointer seccomp cannot read) so libc falls back to clone,
 * where CLONE_NEWUSER is visible and refused, as in unshare.
 */
#define FLEET_NEWEST_REVIEWED_SYSCALL 462

static void install_seccomp(void) {
  struct sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
#if defined(__x86_64__)
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
#elif defined(__aarch64__)
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_AARCH64, 1, 0),
#else
#error "fleet-sandbox: add this architecture's AUDIT_ARCH"
#endif
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
#if defined(__x86_64__)
      /* the x32 ABI shares AUDIT_ARCH_X86_64: refuse it whole */
      BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
#endif
      /* A deny list cannot name what the kernel adds after it was written (open_tree_attr, 467, is a new mount
         call on 6.18): every number past the newest one reviewed here is ENOSYS, what libc takes as "this
         kernel has no such call" and falls back from. 462 is mseal; numbers from 425 on are one table for
         every architecture. */
      BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, FLEET_NEWEST_REVIEWED_SYSCALL, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone3, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_unshare, 1, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 0, 4),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NEWUSER, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      DENY(SYS_keyctl), DENY(SYS_add_key), DENY(SYS_request_key),
      DENY(SYS_bpf), DENY(SYS_perf_event_open), DENY(SYS_userfaultfd),
      DENY(SYS_kexec_load), DENY(SYS_kexec_file_load),
      DENY(SYS_init_module), DENY(SYS_finit_module), DENY(SYS_delete_module),
      DENY(SYS_open_by_handle_at), DENY(SYS_name_to_handle_at),
      DENY(SYS_mount), DENY(SYS_umount2), DENY(SYS_pivot_root), DENY(SYS_chroot),
      DENY(SYS_open_tree), DENY(SYS_move_mount), DENY(SYS_fsopen), DENY(SYS_fsconfig),
      DENY(SYS_fsmount), DENY(SYS_fspick), DENY(SYS_mount_setattr),
      DENY(SYS_setns), DENY(SYS_swapon), DENY(SYS_swapoff), DENY(SYS_reboot),
      DENY(SYS_acct), DENY(SYS_quotactl), DENY(SYS_quotactl_fd), DENY(SYS_syslog),
      DENY(SYS_settimeofday), DENY(SYS_clock_settime), DENY(SYS_clock_adjtime), DENY(SYS_adjtimex),
      DENY(SYS_kcmp), DENY(SYS_process_vm_readv), DENY(SYS_process_vm_writev),
      DENY(SYS_lookup_dcookie), DENY(SYS_uselib), DENY(SYS_ustat), DENY(SYS_sysfs),
      DENY(SYS_vhangup), DENY(SYS_io_uring_setup), DENY(SYS_io_uring_enter), DENY(SYS_io_uring_register),
#if defined(__x86_64__)
      DENY(SYS_iopl), DENY(SYS_ioperm), DENY(SYS__sysctl), DENY(SYS_create_module),
      DENY(SYS_get_kernel_syms), DENY(SYS_query_module), DENY(SYS_nfsservctl),
#endif
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {(unsigned short)(sizeof f / sizeof f[0]), f};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no_new_privs", NULL);
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0) fail("seccomp", NULL);
}

static void confine(int net_raw) {
  drop_caps(net_raw);
  install_seccomp();
}

/* ---- the guest environment ---- */

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

/* FLEET_E0..FLEET_E<n-1> decoded, in order; the host environment is then cleared. */
static char **guest_env(void) {
  size_t n = 0;
  char name[32];
  for (;; n++) {
    snprintf(name, sizeof name, "FLEET_E%zu", n);
    if (!getenv(name)) break;
  }
  char **out = calloc(n + 1, sizeof *out);
  if (!out) fail("calloc", NULL);
  for (size_t i = 0; i < n; i++) {
    snprintf(name, sizeof name, "FLEET_E%zu", i);
    const char *hex = getenv(name);
    size_t len = strlen(hex);
    if (len % 2) usage();
    char *s = malloc(len / 2 + 1);
    if (!s) fail("malloc", NULL);
    for (size_t j = 0; j < len / 2; j++) {
      int hi = hexval(hex[2 * j]), lo = hexval(hex[2 * j + 1]);
      if (hi < 0 || lo < 0) usage();
      s[j] = (char)(hi * 16 + lo);
    }
    s[len / 2] = 0;
    if (!strchr(s, '=') || strlen(s) != len / 2) usage();
    out[i] = s;
  }
  clearenv();
  return out;
}

/* ---- boot ---- */

/* runc's and Docker's defaults: hidden (read as empty) and read-only. Paths relative to the new root (cwd). */
static const char *MASKED[] = {"proc/kcore", "proc/keys", "proc/timer_list", "proc/timer_stats", "proc/sched_debug",
                               "proc/latency_stats", "proc/acpi", "proc/asound", "proc/scsi", "sys/firmware",
                               "sys/devices/virtual/powercap"};
static const char *READONLY[] = {"proc/bus", "proc/fs", "proc/irq", "proc/sys", "proc/sysrq-trigger"};

/* EMPTYDIR of the start: the sandbox's own empty directory (helper.ts emptyDirOf). */
static const char *empty_dir;

/* A bind of SRC at DST (recursive with MS_REC in REC), then made read-only, nosuid, nodev and noexec. */
static int bind_read_only(const char *src, const char *dst, unsigned long rec) {
  if (mount(src, dst, NULL, MS_BIND | rec, NULL) < 0) return -1;
  return mount(NULL, dst, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

/*
 * A masked directory is a read-only bind of the sandbox's empty directory, not a tmpfs of its own: CRIU dumps a
 * tmpfs by running tar and gzip over it (while the guest is frozen) and restores it by running them again, at every
 * pause, resume, fork and move; a bind of a host directory is an external mount (criu.ts), which costs neither.
 * The guest cannot write there either way: the directory belongs to host root, which has no id in the sandbox.
 */
static void mask_paths(void) {
  struct stat st;
  for (size_t i = 0; i < sizeof MASKED / sizeof MASKED[0]; i++) {
    if (lstat(MASKED[i], &st) < 0) continue;
    int r = S_ISDIR(st.st_mode) ? bind_read_only(empty_dir, MASKED[i], 0) : mount("/dev/null", MASKED[i], NULL, MS_BIND, NULL);
    if (r < 0) fail("mask", MASKED[i]);
  }
  for (size_t i = 0; i < sizeof READONLY / sizeof READONLY[0]; i++) {
    if (lstat(READONLY[i], &st) < 0) continue;
    if (bind_read_only(READONLY[i], READONLY[i], MS_REC) < 0) fail("make read-only", READONLY[i]);
  }
}

static int boot(int net_raw) {
  clearenv();
  mask_paths();
  if (syscall(SYS_pivot_root, ".", ".") < 0) fail("pivot_root", NULL);
  if (umount2(".", MNT_DETACH) < 0) fail("detach the old root", NULL);
  if (chdir("/") < 0) fail("chdir /", NULL);
  confine(net_raw);
  if (write(3, "ready\n", 6) != 6) fail("write the ready signal", NULL);
  /* Nothing of the set-up (the ready pipe, a shell's saved copies of it) reaches the guest. */
  if (syscall(SYS_close_range, 3, ~0U, 0) < 0) fail("close_range", NULL);
  char *init_argv[] = {"init", NULL};
  char *init_env[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", NULL};
  execve("/sbin/init", init_argv, init_env);
  fail("exec", "/sbin/init");
  return 125;
}

/* ---- stage 2 ---- */

#include <time.h>

/*
 * The start's waits (the root mount, eth0) for the agent's steps end where the agent gives up on the ready signal
 * (launch.ts, 15 s from the spawn): counts of 500 µs sleeps gave up after ~4 s (eth0) and ~6 s (root), which a
 * loaded host's agent can overrun. Between checks the sleep grows from 200 µs to 2 ms: at most ~500 wake-ups a
 * second instead of ~2000, for ~1 ms more on average between the agent's step and this process seeing it.
 */
#define START_TIMEOUT_MS 15000

static long long monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Set by cmd_start before it forks the init. */
static long long start_deadline_ns;

/* One sleep between two checks: 0 once the start's deadline has passed. */
static int backoff(unsigned *delay_us) {
  if (monotonic_ns() >= start_deadline_ns) return 0;
  usleep(*delay_us);
  *delay_us = *delay_us * 3 / 2 > 2000 ? 2000 : *delay_us * 3 / 2;
  return 1;
}

#include <arpa/inet.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <sys/socket.h>

/* One rtnetlink request, acknowledged; 0 or -errno. */
static int rtnl(int fd, struct nlmsghdr *req) {
  static unsigned seq;
  req->nlmsg_flags |= NLM_F_REQUEST | NLM_F_ACK;
  req->nlmsg_seq = ++seq;
  if (send(fd, req, req->nlmsg_len, 0) < 0) return -errno;
  char buf[4096];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)n); h = NLMSG_NEXT(h, n)) {
      if (h->nlmsg_seq != req->nlmsg_seq || h->nlmsg_type != NLMSG_ERROR) continue;
      return ((struct nlmsgerr *)NLMSG_DATA(h))->error;
    }
  }
}

static void rta_add(struct nlmsghdr *h, unsigned short type, const void *data, unsigned short len) {
  struct rtattr *a = (struct rtattr *)((char *)h + NLMSG_ALIGN(h->nlmsg_len));
  a->rta_type = type;
  a->rta_len = (unsigned short)RTA_LENGTH(len);
  memcpy(RTA_DATA(a), data, len);
  h->nlmsg_len = NLMSG_ALIGN(h->nlmsg_len) + RTA_ALIGN(a->rta_len);
}

/* One rtnetlink request: its header, the message's own header, room for its attributes. */
struct rtnl_req {
  struct nlmsghdr h;
  union {
    struct ifinfomsg ifi;
    struct ifaddrmsg ifa;
    struct rtmsg rt;
  } u;
  char attrs[512];
};

/* REQ emptied and begun as a TYPE request with FLAGS whose own header is LEN bytes. */
static void rtnl_begin(struct rtnl_req *req, unsigned short type, unsigned short flags, size_t len) {
  memset(req, 0, sizeof *req);
  req->h.nlmsg_len = NLMSG_LENGTH(len);
  req->h.nlmsg_type = type;
  req->h.nlmsg_flags = flags;
}

/* REQ begun as an IPv4 unicast route of the main table, protocol boot (as ip(8) adds one), in SCOPE. */
static void rtnl_begin_route(struct rtnl_req *req, unsigned short flags, unsigned char scope) {
  rtnl_begin(req, RTM_NEWROUTE, flags, sizeof req->u.rt);
  req->u.rt.rtm_family = AF_INET;
  req->u.rt.rtm_table = RT_TABLE_MAIN;
  req->u.rt.rtm_protocol = RTPROT_BOOT;
  req->u.rt.rtm_scope = scope;
  req->u.rt.rtm_type = RTN_UNICAST;
}

static void link_up(int ioc, const char *name) {
  struct ifreq ifr;
  memset(&ifr, 0, sizeof ifr);
  strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
  if (ioctl(ioc, SIOCGIFFLAGS, &ifr) < 0) fail("read the flags of", name);
  ifr.ifr_flags |= IFF_UP;
  if (ioctl(ioc, SIOCSIFFLAGS, &ifr) < 0) fail("set up", name);
}

/*
 * What `ip addr add ADDR/LEN dev eth0; ip link set eth0 up; ip route add default via GW dev eth0` did:
 * the address (no broadcast), the link up, the default route (proto boot, as ip(8) adds it).
 */
static void configure_eth0(const char *cidr, const char *gw) {
  char addr[32];
  const char *slash = strchr(cidr, '/');
  if (!slash || (size_t)(slash - cidr) >= sizeof addr) usage();
  memcpy(addr, cidr, (size_t)(slash - cidr));
  addr[slash - cidr] = 0;
  int len = atoi(slash + 1);
  struct in_addr a, g;
  if (len < 1 || len > 32 || inet_pton(AF_INET, addr, &a) != 1 || inet_pton(AF_INET, gw, &g) != 1) usage();
  int ioc = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  int nl = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  if (ioc < 0 || nl < 0) fail("socket", NULL);
  unsigned idx = if_nametoindex("eth0");
  if (!idx) fail("find", "eth0");
  struct rtnl_req req;
  rtnl_begin(&req, RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, sizeof req.u.ifa);
  req.u.ifa.ifa_family = AF_INET;
  req.u.ifa.ifa_prefixlen = (unsigned char)len;
  req.u.ifa.ifa_index = idx;
  rta_add(&req.h, IFA_LOCAL, &a, 4);
  rta_add(&req.h, IFA_ADDRESS, &a, 4);
  int e = rtnl(nl, &req.h);
  if (e < 0) errno = -e, fail("add the address of", "eth0");
  link_up(ioc, "eth0");
  rtnl_begin_route(&req, NLM_F_CREATE | NLM_F_EXCL, RT_SCOPE_UNIVERSE);
  rta_add(&req.h, RTA_GATEWAY, &g, 4);
  rta_add(&req.h, RTA_OIF, &idx, 4);
  e = rtnl(nl, &req.h);
  if (e < 0) errno = -e, fail("add the default route via", gw);
  close(nl);
  close(ioc);
}

static void must_mount(const char *src, const char *target, const char *type, unsigned long flags, const char *data) {
  if (mount(src, target, type, flags, data) < 0) fail("mount", target);
}

static int is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/*
 * Stage 2 of a start, as root of the new namespaces with the new root as the working directory (the
 * shell script it replaces ran about twenty busybox applets): proc, sysfs (the netns belongs to the
 * user namespace), a tmpfs /dev with the host's harmless nodes bind-mounted (mknod is refused in a
 * user namespace), devpts, the hostname; then it waits for the agent to move eth0 in, configures it,
 * and boots (masks, pivot_root, confinement, the ready signal, /sbin/init).
 */
static int stage2(const char *host, const char *cidr, const char *gw, int net_raw) {
  struct stat st;
  if (lstat("sbin/init", &st) < 0) {
    dprintf(2, "fleet: the image has no /sbin/init\n");
    _exit(65);
  }
  static const char *DIRS[] = {"proc", "dev", "tmp"};
  for (size_t i = 0; i < 3; i++)
    if (!is_dir(DIRS[i]) && mkdir(DIRS[i], 0777) < 0) fail("mkdir", DIRS[i]);
  must_mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
  /* As Docker does: ping through ICMP datagram sockets, so it needs no CAP_NET_RAW (this netns only). */
  int fd = open("proc/sys/net/ipv4/ping_group_range", O_WRONLY | O_CLOEXEC);
  if (fd < 0 || write(fd, "0 65535\n", 8) != 8) fail("write", "ping_group_range");
  close(fd);
  if (is_dir("sys")) must_mount("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
  must_mount("tmpfs", "dev", "tmpfs", MS_NOSUID, "mode=755,size=64m,uid=0,gid=0");
  if (mkdir("dev/pts", 0777) < 0 || mkdir("dev/shm", 0777) < 0 || chmod("dev/shm", 01777) < 0) fail("populate", "/dev");
  static const char *NODES[] = {"null", "zero", "full", "random", "urandom", "tty"};
  for (size_t i = 0; i < sizeof NODES / sizeof NODES[0]; i++) {
    char host_node[32], node[32];
    snprintf(host_node, sizeof host_node, "/dev/%s", NODES[i]);
    snprintf(node, sizeof node, "dev/%s", NODES[i]);
    int n = open(node, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (n < 0) fail("create", node);
    close(n);
    must_mount(host_node, node, NULL, MS_BIND, NULL);
  }
  static const char *LINKS[][2] = {{"/proc/self/fd", "dev/fd"},         {"/proc/self/fd/0", "dev/stdin"},
                                   {"/proc/self/fd/1", "dev/stdout"},   {"/proc/self/fd/2", "dev/stderr"},
                                   {"pts/ptmx", "dev/ptmx"}};
  for (size_t i = 0; i < sizeof LINKS / sizeof LINKS[0]; i++)
    if (symlink(LINKS[i][0], LINKS[i][1]) < 0) fail("symlink", LINKS[i][1]);
  /* Best effort, as before (a kernel without devpts newinstance still boots). */
  mount("devpts", "dev/pts", "devpts", 0, "newinstance,ptmxmode=0666,mode=620");
  if (sethostname(host, strlen(host)) < 0) fail("sethostname", host);
  int ioc = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (ioc < 0) fail("socket", NULL);
  link_up(ioc, "lo");
  close(ioc);
  /* The agent creates eth0 in this network namespace (network.ts attachSandbox) while the above runs. */
  for (unsigned delay = 200; !if_nametoindex("eth0");) {
    if (!backoff(&delay)) {
      dprintf(2, "fleet: eth0 never arrived\n");
      _exit(66);
    }
  }
  configure_eth0(cidr, gw);
  return boot(net_raw);
}

/* ---- wait-root ---- */

/* Waits until the agent has mapped the ids and mounted ROOT, enters it and becomes root of the user namespace. */
static void wait_root(const char *root) {
  char parent[4096];
  if (snprintf(parent, sizeof parent, "%s/..", root) >= (int)sizeof parent) usage();
  for (unsigned delay = 200;;) {
    struct stat a, b;
    if (stat(root, &a) == 0 && stat(parent, &b) == 0 && a.st_dev != b.st_dev) break;
    if (!backoff(&delay)) {
      dprintf(2, "fleet: the sandbox root was never mounted\n");
      _exit(67);
    }
  }
  /* As the namespace's root the data directory (0700, host root's) is closed: stage 2 works from here. */
  if (chdir(root) < 0) fail("chdir", root);
  if (setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0) fail("become root of the user namespace", NULL);
}

/* ---- the reaper ---- */

/* One fixed-width record rewritten in place: the directory is not writable from the new user namespace. */
static void write_status(int fd, const char *text) {
  char rec[96];
  snprintf(rec, sizeof rec, "%-94s\n", text);
  if (pwrite(fd, rec, strlen(rec), 0) < 0) { /* nothing to tell it to */ }
  fsync(fd);
}

/* Field 22 of /proc/PID/stat (start time in clock ticks) into out; 0 when unreadable. */
static int start_of(int pid, char *out, size_t size) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  char *p = strrchr(buf, ')');
  if (!p) return 0;
  p += 2;
  for (int field = 3; field < 22 && p; field++) {
    p = strchr(p, ' ');
    if (p) p++;
  }
  if (!p) return 0;
  size_t len = strcspn(p, " ");
  if (len == 0 || len >= size) return 0;
  memcpy(out, p, len);
  out[len] = 0;
  return 1;
}

/*
 * Called as host root, before the user namespace (start) or before joining it (enter). A process may lower its
 * oom_score_adj down to its floor, oom_score_adj_min, which only a writer with CAP_SYS_RESOURCE on the host sets
 * (to the value it writes), and which every fork inherits; a write from inside the sandbox never changes it. So
 * the floor this process has now is the guest's for good: an agent (or its unit) at -1000 would hand every guest
 * process the right to exempt itself from the OOM killer. Written here: the current value, or 0 if it is
 * negative, which with CAP_SYS_RESOURCE makes it the floor as well. Without that capability the floor stays what
 * it was and cannot be below what the host side could set anyway.
 */
static void guest_oom_floor(void) {
  char adj[16] = "";
  int fd = open("/proc/self/oom_score_adj", O_RDWR | O_CLOEXEC);
  ssize_t n = fd < 0 ? -1 : read(fd, adj, sizeof adj - 1);
  if (n <= 0) fail("read /proc/self/oom_score_adj", NULL);
  adj[n] = 0;
  long v = strtol(adj, NULL, 10);
  char out[16];
  int len = snprintf(out, sizeof out, "%ld", v < 0 ? 0 : v);
  if (pwrite(fd, out, (size_t)len, 0) != len) fail("write /proc/self/oom_score_adj", NULL);
  close(fd);
}

/* The init's parent from here on: records how it ends (see the header), nothing else. */
static int reap(int sfd, pid_t init) {
  /* The console FIFO and the ready pipe are the sandbox's: held here, they would outlive its last process. */
  int null = open("/dev/null", O_RDWR);
  if (null >= 0) dup2(null, 0), dup2(null, 1), dup2(null, 2);
  if (sfd != 3) dup2(sfd, 3);
  syscall(SYS_close_range, 4, ~0U, 0);
  char start[32] = "", line[96];
  int st = 0;
  for (int i = 0; i < 1000 && !start_of(init, start, sizeof start); i++) usleep(1000);
  snprintf(line, sizeof line, "%d %s running", init, start);
  write_status(3, line);
  for (;;) {
    pid_t r = waitpid(init, &st, 0);
    if (r == init) break;
    if (errno != EINTR) return 0;
  }
  if (WIFEXITED(st)) snprintf(line, sizeof line, "%d %s exited %d", init, start, WEXITSTATUS(st));
  else if (WIFSIGNALED(st)) snprintf(line, sizeof line, "%d %s signaled %d", init, start, WTERMSIG(st));
  else return 0;
  write_status(3, line);
  return 0;
}

/* ---- mask-ro ---- */

#include <linux/openat2.h>

static int open_ns(int pid, const char *ns);

/* Makes each of PATHS (mount points in PID's root, resolved with no symlink followed) read-only, nosuid, nodev and
   noexec, in PID's mount namespace, which this process joins. */
static void mask_ro(int pid, char **paths, int n) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/root", pid);
  int root = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (root < 0) fail("open", path);
  int ns = open_ns(pid, "ns/mnt");
  /* mount_setattr changes only mounts of the caller's own mount namespace. */
  if (setns(ns, CLONE_NEWNS) < 0) fail("setns", "mnt");
  for (int i = 0; i < n; i++) {
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = O_PATH | O_DIRECTORY | O_CLOEXEC;
    how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    int fd = (int)syscall(SYS_openat2, root, paths[i], &how, sizeof how);
    if (fd < 0) fail("open", paths[i]);
    struct mount_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0) fail("mount_setattr", paths[i]);
    close(fd);
  }
  close(ns);
  close(root);
}

/* ---- mount-root ---- */

static int idmapped_clone(const char *path, int userns) {
  int fd = (int)syscall(SYS_open_tree, AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
  if (fd < 0) fail("open_tree", path);
  struct mount_attr attr;
  memset(&attr, 0, sizeof attr);
  attr.attr_set = MOUNT_ATTR_IDMAP;
  attr.userns_fd = (unsigned long long)userns;
  if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0) fail("idmap (mount_setattr)", path);
  return fd;
}

static void write_file(const char *path, const char *text);

/*
 * A user namespace of no process's, mapping ids 0..65535 to HOSTID..: a child unshares into a new one, its maps are
 * written, and the namespace is kept by a descriptor after the child has gone.
 */
static int throwaway_userns(long hostid) {
  int ready[2], gate[2];
  if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(gate, O_CLOEXEC) < 0) fail("pipe", NULL);
  pid_t child = fork();
  if (child < 0) fail("fork", NULL);
  if (child == 0) {
    /* In the new namespace, then held until the parent has its descriptor: the end of the gate. */
    close(ready[0]);
    close(gate[1]);
    char b = unshare(CLONE_NEWUSER) < 0 ? 'E' : 'U';
    if (write(ready[1], &b, 1) != 1 || b != 'U') _exit(1);
    while (read(gate[0], &b, 1) < 0 && errno == EINTR) {
    }
    _exit(0);
  }
  close(ready[1]);
  close(gate[0]);
  char b = 0;
  while (read(ready[0], &b, 1) < 0 && errno == EINTR) {
  }
  if (b != 'U') fail("unshare a user namespace", NULL);
  char path[64], map[64];
  snprintf(map, sizeof map, "0 %ld 65536\n", hostid);
  snprintf(path, sizeof path, "/proc/%d/uid_map", (int)child);
  write_file(path, map);
  snprintf(path, sizeof path, "/proc/%d/gid_map", (int)child);
  write_file(path, map);
  snprintf(path, sizeof path, "/proc/%d/ns/user", (int)child);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open", path);
  close(gate[1]);
  close(ready[0]);
  while (waitpid(child, NULL, 0) < 0 && errno == EINTR) {
  }
  return fd;
}

static int cmd_mount_root(int argc, char **argv) {
  if (argc != 7) usage();
  clearenv();
  int pid = atoi(argv[2]);
  long hostid = atol(argv[3]);
  if (pid < 0 || hostid <= 0 || (pid == 0 && strcmp(argv[2], "0") != 0)) usage();
  argv++; /* IMAGE LAYERDIR ROOT at argv[3..5] */
  char path[64];
  int userns, mntns = -1;
  if (pid == 0) {
    userns = throwaway_userns(hostid);
  } else {
    snprintf(path, sizeof path, "/proc/%d/ns/user", pid);
    userns = open(path, O_RDONLY | O_CLOEXEC);
    if (userns < 0) fail("open", path);
    snprintf(path, sizeof path, "/proc/%d/ns/mnt", pid);
    mntns = open(path, O_RDONLY | O_CLOEXEC);
    if (mntns < 0) fail("open", path);
  }
  int lower = idmapped_clone(argv[3], userns);
  int layer = idmapped_clone(argv[4], userns);
  if (mntns >= 0 && setns(mntns, CLONE_NEWNS) < 0) fail("setns", "mnt");
  /* Keep every capability across the fsuid change (no setuid fix-up), so the mount keeps host-root powers. */
  if (prctl(PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP) < 0) fail("securebits", NULL);
  setfsgid((gid_t)hostid);
  setfsuid((uid_t)hostid);
  if (setfsuid((uid_t)-1) != (int)hostid) fail("setfsuid", NULL);
  char opts[512];
  /* /proc here is still the host's: /proc/self/fd/N names the detached idmapped mounts. */
  if (snprintf(opts, sizeof opts,
               "lowerdir=/proc/self/fd/%d,upperdir=/proc/self/fd/%d/upper,workdir=/proc/self/fd/%d/work,index=off,metacopy=off,redirect_dir=off",
               lower, layer, layer) >= (int)sizeof opts)
    usage();
  if (mount("overlay", argv[5], "overlay", 0, opts) < 0) fail("mount the overlay at", argv[5]);
  return 0;
}

/* ---- enter ---- */

static void write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) fail("open", path);
  if (write(fd, text, strlen(text)) < 0) fail("write", path);
  close(fd);
}

/* Field 22 of /proc/PID/stat (start time in clock ticks) equals `start`. */
static int same_start(int pid, const char *start) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  char *p = strrchr(buf, ')');
  if (!p) return 0;
  p += 2; /* field 3 */
  for (int field = 3; field < 22 && p; field++) {
    p = strchr(p, ' ');
    if (p) p++;
  }
  if (!p) return 0;
  size_t len = strcspn(p, " ");
  return len == strlen(start) && strncmp(p, start, len) == 0;
}

static int open_ns(int pid, const char *ns) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/%s", pid, ns);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  /* A kernel without time namespaces has no ns/time: nothing to join there. */
  if (fd < 0 && !(errno == ENOENT && strcmp(ns, "ns/time") == 0)) fail("open", path);
  return fd;
}

/* Copies until EOF, or exactly `limit` bytes when limit >= 0 (an earlier EOF: -1, EIO). */
static int copy_fd(int in, int out, long long limit) {
  static char buf[1 << 17];
  for (;;) {
    if (limit == 0) return 0;
    size_t want = limit > 0 && (unsigned long long)limit < sizeof buf ? (size_t)limit : sizeof buf;
    ssize_t r = read(in, buf, want);
    if (r == 0) {
      if (limit > 0) {
        errno = EIO;
        return -1;
      }
      return 0;
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (limit > 0) limit -= r;
    for (ssize_t off = 0; off < r;) {
      ssize_t w = write(out, buf + off, (size_t)(r - off));
      if (w < 0) {
        if (errno == EINTR) continue;
        return -1;
      }
      off += w;
    }
  }
}

/* mkdir -p of PATH's parent, inside the sandbox (as the guest's root would: mode 0777 less the umask). */
static int make_parents(const char *path) {
  char dir[4096];
  if (snprintf(dir, sizeof dir, "%s", path) >= (int)sizeof dir) return -1;
  char *last = strrchr(dir, '/');
  if (!last || last == dir) return 0;
  *last = 0;
  for (char *p = dir + 1;; p++) {
    if (*p != '/' && *p != 0) continue;
    char c = *p;
    *p = 0;
    if (mkdir(dir, 0777) < 0 && errno != EEXIST) return -1;
    *p = c;
    if (c == 0) return 0;
  }
}

static int op_put(char **a, int parents) {
  const char *path = a[0], *mode = a[1], *tmp = a[2];
  struct stat st;
  if (parents && make_parents(path) < 0) {
    dprintf(2, "the directories of %s: %s\n", path, strerror(errno));
    return 1;
  }
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
    dprintf(2, "is a directory\n");
    return 21;
  }
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    dprintf(2, "%s: %s\n", tmp, strerror(errno));
    return 1;
  }
  if (copy_fd(0, fd, -1) < 0 || fchmod(fd, (mode_t)strtoul(mode, NULL, 8)) < 0 || close(fd) < 0 || rename(tmp, path) < 0) {
    dprintf(2, "%s: %s\n", path, strerror(errno));
    unlink(tmp);
    return 1;
  }
  return 0;
}

static int op_get(char **a) {
  int fd = open(a[0], O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) < 0) {
    dprintf(2, "%s: %s\n", a[0], strerror(errno));
    return 1;
  }
  if (!S_ISREG(st.st_mode)) {
    dprintf(2, "not a regular file\n");
    return 21;
  }
  fcntl(fd, F_SETFL, 0);
  dprintf(1, "%lld\n", (long long)st.st_size);
  /* Never past the size just announced (the agent's Content-Length): the guest may be growing the file. */
  if (copy_fd(fd, 1, (long long)st.st_size) < 0) {
    dprintf(2, "%s: %s\n", a[0], strerror(errno));
    return 1;
  }
  return 0;
}

static const int FORWARDED[] = {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM};

static volatile pid_t forward_to;

/* The host side died (SIGKILLed by the agent on a timeout or a hang-up): everything the exec started goes too. */
static void kill_own_group(int sig) {
  (void)sig;
  kill(0, SIGKILL);
  _exit(137);
}

/*
 * The exec's own session leader inside the sandbox: it runs the command as its child and answers with its status. It
 * exists so that a SIGKILL of the host side, which nothing can forward, still reaches the whole group (its parent-death
 * signal makes it kill the group), as a group kill did when the exec shared the host side's session. Forwarded
 * signals reach the command through the group; this process ignores them, so it lives to report how the command ended.
 */
static int supervise(char **argv, char **envp) {
  sigset_t all, old;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &old);
  pid_t cmd = fork();
  if (cmd < 0) return 126;
  if (cmd == 0) {
    sigprocmask(SIG_SETMASK, &old, NULL);
    environ = envp;
    execvp(argv[0], argv);
    int e = errno;
    dprintf(2, "fleet-sandbox: %s: %s\n", argv[0], strerror(e));
    _exit(e == ENOENT ? 127 : 126);
  }
  for (size_t s = 0; s < sizeof FORWARDED / sizeof FORWARDED[0]; s++) signal(FORWARDED[s], SIG_IGN);
  /* Not one of the forwarded signals: a caller's SIGUSR2 must reach the command, not end the group. */
  signal(SIGRTMIN + 1, kill_own_group);
  prctl(PR_SET_PDEATHSIG, SIGRTMIN + 1);
  /* The host side is outside the sandbox's pid namespace (getppid() is 0); once it is gone this is reparented inside. */
  if (getppid() != 0) kill_own_group(0);
  sigprocmask(SIG_SETMASK, &old, NULL);
  int status;
  while (waitpid(cmd, &status, 0) < 0) {
    if (errno != EINTR) return 126;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  int sig = WTERMSIG(status);
  signal(sig, SIG_DFL);
  prctl(PR_SET_PDEATHSIG, 0);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  sigprocmask(SIG_UNBLOCK, &one, NULL);
  kill(getpid(), sig);
  return 128 + sig;
}

static void forward_signal(int sig) {
  if (forward_to > 0 && kill(-forward_to, sig) < 0) kill(forward_to, sig);
}

static int cmd_enter(int argc, char **argv) {
  if (argc < 3) usage();
  int pid = atoi(argv[2]);
  if (pid <= 0) usage();
  const char *cwd = "/";
  int net_raw = 0, rows = 0, cols = 0, i = 3;
  const char *start = NULL;
  char **cgroups = calloc((size_t)argc, sizeof *cgroups);
  size_t ncg = 0;
  for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
    if (strcmp(argv[i], "--cg") == 0 && i + 1 < argc) cgroups[ncg++] = argv[++i];
    else if (strcmp(argv[i], "--cwd") == 0 && i + 1 < argc) cwd = argv[++i];
    else if (strcmp(argv[i], "--net-raw") == 0) net_raw = 1;
    else if (strcmp(argv[i], "--start") == 0 && i + 1 < argc) start = argv[++i];
    else if (strcmp(argv[i], "--winsize") == 0 && i + 2 < argc) rows = atoi(argv[++i]), cols = atoi(argv[++i]);
    else usage();
  }
  if (i + 1 >= argc) usage();
  char *op = argv[i + 1];
  char **rest = argv + i + 2;
  int nrest = argc - i - 2;
  if (!((strcmp(op, "exec") == 0 && nrest >= 1) || (strcmp(op, "put") == 0 && (nrest == 3 || (nrest == 4 && strcmp(rest[3], "parents") == 0))) ||
        (strcmp(op, "get") == 0 && nrest == 1) || (strcmp(op, "unlink") == 0 && nrest == 1)))
    usage();
  char **envp = guest_env();
  /* Not ptraceable nor its /proc readable by the guest while it still holds more than the guest does. */
  if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) fail("PR_SET_DUMPABLE", NULL);

  if (rows > 0 && cols > 0) {
    struct winsize ws = {(unsigned short)rows, (unsigned short)cols, 0, 0};
    ioctl(0, TIOCSWINSZ, &ws);
  }
  char self[32];
  snprintf(self, sizeof self, "%d", getpid());
  for (size_t c = 0; c < ncg; c++) write_file(cgroups[c], self);
  /* The exec inherits this process's OOM floor, the agent's (or the spawner's) until now. */
  guest_oom_floor();

  int user = open_ns(pid, "ns/user"), root = open_ns(pid, "root");
  /* time: a sandbox CRIU restored runs in a time namespace of its own (its clocks go on from the dump); a process
     started in another could not be dumped and restored with the init's tree. */
  static const char *names[] = {"ipc", "uts", "net", "pid", "cgroup", "time", "mnt"};
  int nss[] = {open_ns(pid, "ns/ipc"),    open_ns(pid, "ns/uts"),  open_ns(pid, "ns/net"), open_ns(pid, "ns/pid"),
               open_ns(pid, "ns/cgroup"), open_ns(pid, "ns/time"), open_ns(pid, "ns/mnt")};
  /* Only the namespaces the sandbox has of its own (it shares the host's cgroup namespace). */
  int join[sizeof nss / sizeof nss[0]];
  for (size_t n = 0; n < sizeof nss / sizeof nss[0]; n++) {
    char mine_path[64];
    struct stat a, b;
    snprintf(mine_path, sizeof mine_path, "/proc/self/ns/%s", names[n]);
    if (nss[n] < 0) {
      join[n] = 0;
      continue;
    }
    if (fstat(nss[n], &a) < 0 || stat(mine_path, &b) < 0) fail("stat namespace", names[n]);
    join[n] = a.st_ino != b.st_ino || a.st_dev != b.st_dev;
  }
  /* The descriptors are held now: if the pid still has the init's start time, they are the init's, not a reused pid's. */
  if (start && !same_start(pid, start)) {
    dprintf(2, "fleet-sandbox: process %d is no longer the sandbox init\n", pid);
    _exit(125);
  }
  struct stat mine, theirs;
  if (fstat(user, &theirs) < 0 || stat("/proc/self/ns/user", &mine) < 0) fail("stat user namespace", NULL);
  if (mine.st_ino != theirs.st_ino || mine.st_dev != theirs.st_dev) {
    /* Joining the user namespace first gives the capabilities (there) to join the others. */
    if (setns(user, CLONE_NEWUSER) < 0) fail("setns", "user");
    /* setgroups may be denied in the namespace: then the (unmapped) group list stays, which grants nothing. */
    if (setgroups(0, NULL) < 0 && errno != EPERM) fail("setgroups", NULL);
    if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0) fail("become root of the user namespace", NULL);
  }
  for (size_t n = 0; n < sizeof nss / sizeof nss[0]; n++) {
    if (join[n] && setns(nss[n], 0) < 0) fail("setns", names[n]);
    if (nss[n] >= 0) close(nss[n]);
  }
  if (fchdir(root) < 0 || chroot(".") < 0) fail("enter the sandbox root", NULL);
  close(root);
  close(user);
  if (chdir(cwd) < 0) fail("cannot change directory to", cwd);

  sigset_t block, old;
  sigemptyset(&block);
  for (size_t s = 0; s < sizeof FORWARDED / sizeof FORWARDED[0]; s++) sigaddset(&block, FORWARDED[s]);
  sigprocmask(SIG_BLOCK, &block, &old);
  pid_t child = fork();
  if (child < 0) fail("fork", NULL);
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* A session of the sandbox's own, not the caller's on the host (unless a terminal is to stay controlling):
       what an exec leaves running is then wholly inside the sandbox, which a memory checkpoint (CRIU) requires. */
    int own_session = !isatty(0) && strcmp(op, "put") != 0 && strcmp(op, "get") != 0 && strcmp(op, "unlink") != 0;
    /* The agent's own file operations stay in the host side's group: its kill must stop a put before the put reads
       the closed stream as the end of the file and renames it into place. */
    if (own_session && setsid() < 0) fail("setsid", NULL);
    sigprocmask(SIG_SETMASK, &old, NULL);
    /* Only stdio: exec (libuv's too) passes on whatever the host side inherited without O_CLOEXEC. */
    if (syscall(SYS_close_range, 3, ~0U, 0) < 0) fail("close_range", NULL);
    confine(net_raw);
    if (strcmp(op, "put") == 0) _exit(op_put(rest, nrest == 4));
    if (strcmp(op, "get") == 0) _exit(op_get(rest));
    if (strcmp(op, "unlink") == 0) _exit(unlink(rest[0]) < 0 && errno != ENOENT ? 1 : 0);
    /* With a session of its own, a supervisor keeps the group killable; with a terminal, the group kill still reaches it. */
    if (!isatty(0)) _exit(supervise(rest, envp));
    environ = envp;
    execvp(rest[0], rest);
    int e = errno;
    dprintf(2, "fleet-sandbox: %s: %s\n", rest[0], strerror(e));
    _exit(e == ENOENT ? 127 : 126);
  }
  /* The host side stays out of the way: the guest decides how it reacts to a signal, which reaches the child's
     group (its own session's, without a terminal) as it used to reach this one's. */
  forward_to = child;
  for (size_t s = 0; s < sizeof FORWARDED / sizeof FORWARDED[0]; s++) signal(FORWARDED[s], forward_signal);
  sigprocmask(SIG_SETMASK, &old, NULL);
  int status;
  while (waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) fail("waitpid", NULL);
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  int sig = WTERMSIG(status);
  signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  sigprocmask(SIG_UNBLOCK, &one, NULL);
  kill(getpid(), sig);
  return 128 + sig;
}

/* ---- serve ---- */

#include <poll.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#define MAX_REQUEST (4u << 20)
#define MAX_ALLOWED 16

/* The host tools `run` may exec: fixed by the serve's argv (--allow), never by a request. */
static const char *allowed_tools[MAX_ALLOWED];
static int n_allowed;

static int read_full(int fd, void *buf, size_t n) {
  for (size_t off = 0; off < n;) {
    ssize_t r = read(fd, (char *)buf + off, n - off);
    if (r == 0) return -1;
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    off += (size_t)r;
  }
  return 0;
}

static int write_full(int fd, const void *buf, size_t n) {
  for (size_t off = 0; off < n;) {
    ssize_t w = write(fd, (const char *)buf + off, n - off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    off += (size_t)w;
  }
  return 0;
}

static void send_frame(int conn, char type, const void *data, uint32_t len) {
  unsigned char hdr[5] = {(unsigned char)type, (unsigned char)len, (unsigned char)(len >> 8), (unsigned char)(len >> 16), (unsigned char)(len >> 24)};
  /* The agent is gone: nobody is left to read the guest's output or to stop it. */
  if (write_full(conn, hdr, 5) < 0 || (len && write_full(conn, data, len) < 0)) kill(0, SIGKILL);
}

static uint32_t le32(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static void relay(int conn) {
  if (setsid() < 0) _exit(125);
  signal(SIGCHLD, SIG_DFL);
  for (size_t s = 0; s < sizeof FORWARDED / sizeof FORWARDED[0]; s++) signal(FORWARDED[s], SIG_IGN);
  uint32_t me = (uint32_t)getpid();
  unsigned char pidle[4] = {(unsigned char)me, (unsigned char)(me >> 8), (unsigned char)(me >> 16), (unsigned char)(me >> 24)};
  send_frame(conn, 'P', pidle, 4);

  unsigned char lenb[4];
  if (read_full(conn, lenb, 4) < 0) _exit(125);
  uint32_t len = le32(lenb);
  if (len < 8 || len > MAX_REQUEST) _exit(125);
  char *req = malloc((size_t)len + 1);
  if (!req || read_full(conn, req, len) < 0) _exit(125);
  req[len] = 0;
  uint32_t nargs = le32((unsigned char *)req), nenv = le32((unsigned char *)req + 4);
  if (nargs < 2 || nargs > len || nenv > len) _exit(125);
  char **argv = calloc((size_t)nargs + 2, sizeof *argv);
  char **envv = calloc((size_t)nenv + 1, sizeof *envv);
  if (!argv || !envv) _exit(125);
  argv[0] = "fleet-sandbox";
  argv[1] = "enter";
  char *p = req + 8, *end = req + len;
  for (uint32_t i = 0; i < nargs + nenv; i++) {
    char *z = memchr(p, 0, (size_t)(end - p));
    if (!z) _exit(125);
    if (i < nargs) argv[i + 1] = p;
    else envv[i - nargs] = p;
    p = z + 1;
  }
  /* Only these three: the socket is never a way to boot, serve, or run a program the agent did not allow at start. */
  int is_enter = strcmp(argv[1], "enter") == 0, is_mount = strcmp(argv[1], "mount-root") == 0, is_run = strcmp(argv[1], "run") == 0;
  if (!is_enter && !is_mount && !is_run) _exit(125);
  if (!is_enter && nenv != 0) _exit(125);
  if (is_run) {
    int ok = 0;
    for (int i = 0; nargs >= 2 && i < n_allowed; i++) ok |= strcmp(argv[2], allowed_tools[i]) == 0;
    if (!ok) _exit(125);
  }
  for (uint32_t i = 0; i < nenv; i++)
    if (strncmp(envv[i], "FLEET_E", 7) != 0 || !strchr(envv[i], '=')) _exit(125);

  int in[2], out[2], err[2];
  if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0) _exit(125);
  pid_t child = fork();
  if (child < 0) _exit(125);
  if (child == 0) {
    /* From here on exactly what a helper spawned by the agent would be: stdio on pipes, nothing else open, default signals. */
    if (dup2(in[0], 0) < 0 || dup2(out[1], 1) < 0 || dup2(err[1], 2) < 0) _exit(125);
    if (syscall(SYS_close_range, 3, ~0U, 0) < 0) _exit(125);
    for (int sig = 1; sig < 32; sig++) signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    clearenv();
    for (uint32_t i = 0; i < nenv; i++)
      if (putenv(envv[i]) != 0) _exit(125);
    if (is_enter) _exit(cmd_enter((int)nargs + 1, argv));
    if (is_mount) _exit(cmd_mount_root((int)nargs + 1, argv));
    char *tool_env[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
    execve(argv[2], argv + 2, tool_env);
    dprintf(2, "fleet-sandbox: exec %s: %s\n", argv[2], strerror(errno));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  close(err[1]);
  fcntl(in[1], F_SETFL, O_NONBLOCK);

  static char buf[1 << 16], inbuf[1 << 16];
  size_t inlen = 0, inoff = 0;
  int conn_eof = 0, out_open = 1, err_open = 1, in_open = 1;
  while (out_open || err_open) {
    struct pollfd fds[4] = {
        {conn, (short)(!conn_eof && inlen == 0 ? POLLIN : 0), 0},
        {out_open ? out[0] : -1, POLLIN, 0},
        {err_open ? err[0] : -1, POLLIN, 0},
        {in_open && inlen > 0 ? in[1] : -1, POLLOUT, 0},
    };
    if (poll(fds, 4, -1) < 0) {
      if (errno == EINTR) continue;
      kill(0, SIGKILL);
    }
    if (fds[0].revents & (POLLHUP | POLLERR)) kill(0, SIGKILL);
    if (fds[0].revents & POLLIN) {
      ssize_t r = read(conn, inbuf, sizeof inbuf);
      if (r > 0 && in_open) inlen = (size_t)r, inoff = 0;
      else if (r == 0) {
        conn_eof = 1;
        if (in_open) close(in[1]), in_open = 0;
      } else if (r < 0 && errno != EINTR) kill(0, SIGKILL);
    }
    if (fds[3].revents) {
      ssize_t w = write(in[1], inbuf + inoff, inlen - inoff);
      if (w > 0) {
        inoff += (size_t)w;
        if (inoff == inlen) inlen = inoff = 0;
      } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
        /* The guest closed its stdin: what is still sent is dropped, as a pipe would. */
        close(in[1]), in_open = 0, inlen = inoff = 0;
      }
      if (!in_open || (conn_eof && inlen == 0 && in_open)) {
        if (in_open) close(in[1]), in_open = 0;
      }
    }
    for (int k = 1; k <= 2; k++) {
      if (!fds[k].revents) continue;
      int fd = k == 1 ? out[0] : err[0];
      ssize_t r = read(fd, buf, sizeof buf);
      if (r > 0) send_frame(conn, k == 1 ? 'O' : 'R', buf, (uint32_t)r);
      else if (r == 0 || errno != EINTR) {
        close(fd);
        if (k == 1) out_open = 0;
        else err_open = 0;
      }
    }
  }
  int status;
  while (waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) kill(0, SIGKILL);
  }
  int32_t code = WIFEXITED(status) ? WEXITSTATUS(status) : -1, sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  unsigned char x[8];
  for (int b = 0; b < 4; b++) x[b] = (unsigned char)((uint32_t)code >> (8 * b)), x[4 + b] = (unsigned char)((uint32_t)sig >> (8 * b));
  send_frame(conn, 'X', x, 8);
  /* Until the agent closes its side: only then may this pid (its process group) be reused. */
  while (read(conn, buf, sizeof buf) > 0) {
  }
  _exit(0);
}

static int cmd_serve(int argc, char **argv) {
  if (argc < 3) usage();
  for (int i = 3; i < argc; i += 2) {
    if (strcmp(argv[i], "--allow") != 0 || i + 1 >= argc || argv[i + 1][0] != '/' || n_allowed >= MAX_ALLOWED) usage();
    allowed_tools[n_allowed++] = argv[i + 1];
  }
  clearenv();
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  struct sockaddr_un addr;
  memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  if (strlen(argv[2]) >= sizeof addr.sun_path) usage();
  strcpy(addr.sun_path, argv[2]);
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0) fail("socket", NULL);
  unlink(argv[2]);
  mode_t old = umask(0177);
  if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0) fail("bind", argv[2]);
  umask(old);
  if (chmod(argv[2], 0600) < 0 || listen(lfd, 128) < 0) fail("listen", argv[2]);
  signal(SIGCHLD, SIG_IGN); /* relays are reaped by the kernel */
  signal(SIGPIPE, SIG_IGN);
  if (write(1, "ready\n", 6) != 6) fail("write the ready signal", NULL);
  for (;;) {
    int conn = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) continue;
      fail("accept", NULL);
    }
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0 || cred.uid != 0) {
      close(conn);
      continue;
    }
    pid_t r = fork();
    if (r == 0) {
      close(lfd);
      relay(conn);
    }
    close(conn);
  }
  return 125;
}

/* ---- start ---- */

/*
 * What the outer shell, unshare(1) and the helper's former `reap` and `wait-root` verbs did, in one process and no exec
 * until /sbin/init: join the cgroup(s), open the status file (as host root), set the guest's OOM
 * floor (guest_oom_floor), then one unshare(2) of user, pid, mount, uts, ipc and net namespaces (the user namespace
 * first, so this process holds every capability in it and keeps them, never exec'ing), mounts
 * private; fork pid 1, which waits for the agent's id maps and root mount and runs stage 2; stay
 * as its reaper.
 */
static int cmd_start(int argc, char **argv) {
  if (argc < 3) usage();
  int n = atoi(argv[2]);
  if (n < 0 || n > argc || argc != 3 + n + 7) usage();
  char **a = argv + 3 + n; /* STATUS ROOT HOSTNAME ADDR/LEN GATEWAY NETRAW EMPTYDIR */
  start_deadline_ns = monotonic_ns() + START_TIMEOUT_MS * 1000000LL;
  clearenv();
  char me[16];
  snprintf(me, sizeof me, "%d\n", (int)getpid());
  for (int i = 0; i < n; i++) write_file(argv[3 + i], me);
  int sfd = open(a[0], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (sfd < 0) fail("open", a[0]);
  /* The init inherits this process's OOM floor. The reaper itself is kept out of the OOM killer's choice by the
     agent, once the init is forked (launch.ts): a -1000 written here would be the floor of every guest process. */
  guest_oom_floor();
  if (unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET) < 0) fail("unshare", NULL);
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) fail("make the mounts private", NULL);
  empty_dir = a[6];
  pid_t init = fork();
  if (init < 0) fail("fork", NULL);
  if (init == 0) {
    close(sfd);
    wait_root(a[1]);
    return stage2(a[2], a[3], a[4], strcmp(a[5], "1") == 0);
  }
  return reap(sfd, init);
}

/* ---- criu-hook ---- */

#include <linux/veth.h>
#include <sys/sysmacros.h>

static struct rtattr *nest_begin(struct nlmsghdr *h, unsigned short type) {
  struct rtattr *a = (struct rtattr *)((char *)h + NLMSG_ALIGN(h->nlmsg_len));
  a->rta_type = type;
  a->rta_len = (unsigned short)RTA_LENGTH(0);
  h->nlmsg_len = NLMSG_ALIGN(h->nlmsg_len) + RTA_ALIGN(a->rta_len);
  return a;
}

static void nest_end(struct nlmsghdr *h, struct rtattr *a) { a->rta_len = (unsigned short)((char *)h + h->nlmsg_len - (char *)a); }

static const char *must_env(const char *name) {
  const char *v = getenv(name);
  if (!v || !*v) {
    dprintf(2, "fleet-sandbox: the environment variable %s is missing\n", name);
    _exit(125);
  }
  return v;
}

static int parse_mac(const char *text, unsigned char mac[6]) {
  unsigned v[6];
  char end;
  if (sscanf(text, "%2x:%2x:%2x:%2x:%2x:%2x%c", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &end) != 6) return -1;
  for (int i = 0; i < 6; i++) mac[i] = (unsigned char)v[i];
  return 0;
}

/* Writes VALUE to a sysctl of LINK's when the kernel has it (no IPv6: nothing to write). */
static void link_sysctl(const char *link, const char *name, const char *value) {
  char path[128];
  snprintf(path, sizeof path, "/proc/sys/net/ipv6/conf/%s/%s", link, name);
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return;
    fail("open", path);
  }
  if (write(fd, value, strlen(value)) < 0) fail("write", path);
  close(fd);
}

/*
 * The host side of a restored sandbox's network, as network.ts attachSandbox makes it at a start, over rtnetlink
 * rather than three ip(8) runs: the veth VETH with its peer eth0 (address MAC) made in the network namespace of PID;
 * IPv6 off and router advertisements refused on VETH before it is up; VETH a port of BRIDGE, up; the host's /32 route
 * to IP on BRIDGE from GW.
 */
static void attach_veth(int pid, const char *veth, const char *mac_text, const char *bridge, const char *ip, const char *gw) {
  unsigned char mac[6];
  struct in_addr dst, src;
  if (strlen(veth) >= IFNAMSIZ || parse_mac(mac_text, mac) < 0 || inet_pton(AF_INET, ip, &dst) != 1 || inet_pton(AF_INET, gw, &src) != 1)
    usage();
  unsigned br = if_nametoindex(bridge);
  if (!br) fail("find the bridge", bridge);
  int nl = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  if (nl < 0) fail("socket", NULL);
  struct rtnl_req req;
  rtnl_begin(&req, RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, sizeof req.u.ifi);
  req.u.ifi.ifi_family = AF_UNSPEC;
  rta_add(&req.h, IFLA_IFNAME, veth, (unsigned short)(strlen(veth) + 1));
  struct rtattr *info = nest_begin(&req.h, IFLA_LINKINFO);
  rta_add(&req.h, IFLA_INFO_KIND, "veth", 5);
  struct rtattr *data = nest_begin(&req.h, IFLA_INFO_DATA);
  struct rtattr *peer = nest_begin(&req.h, VETH_INFO_PEER);
  req.h.nlmsg_len += sizeof(struct ifinfomsg); /* the peer's own (zeroed) header */
  rta_add(&req.h, IFLA_IFNAME, "eth0", 5);
  uint32_t ns_pid = (uint32_t)pid;
  rta_add(&req.h, IFLA_NET_NS_PID, &ns_pid, 4);
  rta_add(&req.h, IFLA_ADDRESS, mac, 6);
  nest_end(&req.h, peer);
  nest_end(&req.h, data);
  nest_end(&req.h, info);
  int e = rtnl(nl, &req.h);
  if (e < 0) errno = -e, fail("add the veth", veth);
  unsigned idx = if_nametoindex(veth);
  if (!idx) fail("find the veth", veth);
  link_sysctl(veth, "disable_ipv6", "1");
  link_sysctl(veth, "accept_ra", "0");
  rtnl_begin(&req, RTM_NEWLINK, 0, sizeof req.u.ifi);
  req.u.ifi.ifi_family = AF_UNSPEC;
  req.u.ifi.ifi_index = (int)idx;
  req.u.ifi.ifi_flags = IFF_UP;
  req.u.ifi.ifi_change = IFF_UP;
  rta_add(&req.h, IFLA_MASTER, &br, 4);
  e = rtnl(nl, &req.h);
  if (e < 0) errno = -e, fail("attach the veth to", bridge);
  rtnl_begin_route(&req, NLM_F_CREATE | NLM_F_REPLACE, RT_SCOPE_LINK);
  req.u.rt.rtm_dst_len = 32;
  rta_add(&req.h, RTA_DST, &dst, 4);
  rta_add(&req.h, RTA_PREFSRC, &src, 4);
  rta_add(&req.h, RTA_OIF, &br, 4);
  e = rtnl(nl, &req.h);
  if (e < 0) errno = -e, fail("add the route to", ip);
  close(nl);
}

/*
 * The guest side, in a child that joins PID's user namespace (so the ping range's group ids are the sandbox's) and
 * network namespace: lo and eth0 up, eth0's address and default route (as stage 2 does at a start), the ping range.
 */
static void configure_guest_net(int pid, const char *cidr, const char *gw) {
  int userns = open_ns(pid, "ns/user"), netns = open_ns(pid, "ns/net");
  pid_t child = fork();
  if (child < 0) fail("fork", NULL);
  if (child == 0) {
    /* Host root's uid in the sandbox's user namespace: not dumpable, so nothing of the sandbox's could attach to it
       (no task of the tree runs before CRIU resumes it, and the guest has no CAP_SYS_PTRACE: a third wall). Set
       before the joins and checked after them, in case a credential change ever resets it. */
    if (prctl(PR_SET_DUMPABLE, 0) < 0) fail("prctl", "dumpable");
    if (setns(userns, CLONE_NEWUSER) < 0) fail("setns", "user");
    if (setns(netns, CLONE_NEWNET) < 0) fail("setns", "net");
    if (prctl(PR_GET_DUMPABLE) != 0 && prctl(PR_SET_DUMPABLE, 0) < 0) fail("prctl", "dumpable");
    int ioc = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (ioc < 0) fail("socket", NULL);
    link_up(ioc, "lo");
    close(ioc);
    configure_eth0(cidr, gw);
    write_file("/proc/sys/net/ipv4/ping_group_range", "0 65535\n");
    _exit(0);
  }
  int status;
  while (waitpid(child, &status, 0) < 0)
    if (errno != EINTR) fail("wait for", "the guest side of the network");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) exit(125);
  close(userns);
  close(netns);
}

/* Undoes mountinfo's octal escapes (\\040 for a space, ...) in place. */
static void unescape_octal(char *s) {
  char *w = s;
  for (char *r = s; *r;) {
    if (r[0] == '\\' && r[1] >= '0' && r[1] <= '3' && r[2] >= '0' && r[2] <= '7' && r[3] >= '0' && r[3] <= '7') {
      *w++ = (char)((r[1] - '0') * 64 + (r[2] - '0') * 8 + (r[3] - '0'));
      r += 4;
    } else *w++ = *r++;
  }
  *w = 0;
}

/*
 * The masked directories of a restored tree: the mounts in PID's mountinfo of EMPTYDIR's device whose root ends in
 * its name (what criu.ts externalMounts finds at a dump), made read-only, nosuid, nodev and noexec (mask_ro).
 */
static void mask_empty_binds(int pid, const char *empty_dir) {
  struct stat st;
  if (stat(empty_dir, &st) < 0) fail("stat", empty_dir);
  const char *base = strrchr(empty_dir, '/');
  base = base ? base + 1 : empty_dir;
  size_t blen = strlen(base);
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/mountinfo", pid);
  FILE *f = fopen(path, "re");
  if (!f) fail("open", path);
  static char root[4096], mp[4096];
  char *found[64];
  int n = 0;
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, f) > 0) {
    unsigned maj, min;
    if (sscanf(line, "%*d %*d %u:%u %4095s %4095s", &maj, &min, root, mp) != 4) continue;
    if (makedev(maj, min) != st.st_dev) continue;
    unescape_octal(root);
    unescape_octal(mp);
    size_t rlen = strlen(root);
    if (rlen <= blen || strcmp(root + rlen - blen, base) != 0 || root[rlen - blen - 1] != '/') continue;
    if (n == (int)(sizeof found / sizeof found[0])) fail("count the masked directories of", path);
    if (!(found[n++] = strdup(mp))) fail("strdup", NULL);
  }
  free(line);
  fclose(f);
  mask_ro(pid, found, n);
}

/* The hostname of PID's uts namespace (a fork's is its own name, not its source's), joined by this process. */
static void set_hostname(int pid, const char *name) {
  int ns = open_ns(pid, "ns/uts");
  if (setns(ns, CLONE_NEWUTS) < 0) fail("setns", "uts");
  if (sethostname(name, strlen(name)) < 0) fail("sethostname", name);
  close(ns);
}

/*
 * CRIU's action script for a restore (criu.ts): CRIU runs it with no argument at each step, the step in
 * CRTOOLS_SCRIPT_ACTION and the agent's FLEET_* variables in its environment.
 *   setup-namespaces   the restored, empty network namespace of CRTOOLS_INIT_PID gets its eth0: attach_veth with
 *                      FLEET_VETH FLEET_MAC FLEET_BRIDGE FLEET_IP FLEET_GW, then configure_guest_net with
 *                      FLEET_IP/FLEET_PREFIX.
 *   post-restore       every task restored, none running yet: the hostname is FLEET_HOSTNAME; the binds of
 *                      FLEET_EMPTY_DIR (the masked directories) get their flags back (mask_empty_binds).
 *   post-resume        the tree runs and holds its root: FLEET_ROOT, the agent's mount of it for CRIU, is detached.
 * Every other step: nothing. A failure exits non-zero, which fails the restore.
 */
static int cmd_criu_hook(const char *action) {
  if (strcmp(action, "setup-namespaces") == 0) {
    int pid = atoi(must_env("CRTOOLS_INIT_PID"));
    if (pid <= 0) usage();
    const char *ip = must_env("FLEET_IP"), *gw = must_env("FLEET_GW"), *prefix = must_env("FLEET_PREFIX");
    attach_veth(pid, must_env("FLEET_VETH"), must_env("FLEET_MAC"), must_env("FLEET_BRIDGE"), ip, gw);
    char cidr[40];
    if (snprintf(cidr, sizeof cidr, "%s/%s", ip, prefix) >= (int)sizeof cidr) usage();
    configure_guest_net(pid, cidr, gw);
  } else if (strcmp(action, "post-restore") == 0) {
    int pid = atoi(must_env("CRTOOLS_INIT_PID"));
    if (pid <= 0) usage();
    set_hostname(pid, must_env("FLEET_HOSTNAME"));
    mask_empty_binds(pid, must_env("FLEET_EMPTY_DIR"));
  } else if (strcmp(action, "post-resume") == 0) {
    const char *root = getenv("FLEET_ROOT");
    if (root && *root && umount2(root, MNT_DETACH | UMOUNT_NOFOLLOW) < 0 && errno != EINVAL) fail("detach", root);
  }
  return 0;
}

int main(int argc, char **argv) {
  /* Run by CRIU as its action script: no argument, the step in the environment. */
  if (argc == 1 && getenv("CRTOOLS_SCRIPT_ACTION")) return cmd_criu_hook(getenv("CRTOOLS_SCRIPT_ACTION"));
  if (argc < 2) usage();
  if (strcmp(argv[1], "enter") == 0) return cmd_enter(argc, argv);
  if (strcmp(argv[1], "mount-root") == 0) return cmd_mount_root(argc, argv);
  if (strcmp(argv[1], "serve") == 0) return cmd_serve(argc, argv);
  if (strcmp(argv[1], "start") == 0) return cmd_start(argc, argv);
  usage();
  return 125;
}
