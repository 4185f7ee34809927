/*
 * fleet-guest-agent: the in-guest half of the qemu backend. Built static by
 * `image build --backend qemu` and baked into the VM's root image.
 *
 * One TCP connection = one guest process. Frames both ways are
 * type (1 byte) + length (4 bytes, big endian) + payload.
 *   host -> guest: 'A' token (must come first), 'X' exec request,
 *                  'I' stdin bytes, 'E' stdin EOF, 'S' signal number, 'R' "rows cols"
 *   guest -> host: 'O' stdout, 'e' stderr, 'Z' "<exit code> <signal>" (last frame)
 * The exec request is NUL-terminated strings: argc, argv..., envc, env..., cwd,
 * tty (0/1), rows, cols, stdin (0/1). Closing the connection kills the
 * process group. The token is read from the seed per connection; a connection that
 * does not present it first is closed without an answer.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#define MAX_FRAME (1 << 20)

static char token[256];
static size_t token_len;
static const char *token_path;

/* Read again for every connection: a restored copy of this VM (a fork) is given its own token by the host. */
static int load_token(void) {
  int fd = open(token_path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    perror("token file");
    return -1;
  }
  ssize_t n = read(fd, token, sizeof token - 1);
  close(fd);
  while (n > 0 && (token[n - 1] == '\n' || token[n - 1] == ' ')) n--;
  if (n < 16) {
    fprintf(stderr, "token too short\n");
    return -1;
  }
  token_len = (size_t)n;
  return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

static int read_all(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static int send_frame(int fd, char type, const void *data, uint32_t len) {
  unsigned char hdr[5] = {(unsigned char)type, len >> 24, (len >> 16) & 255, (len >> 8) & 255, len & 255};
  if (write_all(fd, hdr, 5) < 0) return -1;
  return len ? write_all(fd, data, len) : 0;
}

/* Reads one frame; *data is malloc'd (NUL-terminated for convenience). */
static int recv_frame(int fd, char *type, char **data, uint32_t *len) {
  unsigned char hdr[5];
  if (read_all(fd, hdr, 5) < 0) return -1;
  uint32_t n = ((uint32_t)hdr[1] << 24) | ((uint32_t)hdr[2] << 16) | ((uint32_t)hdr[3] << 8) | hdr[4];
  if (n > MAX_FRAME) return -1;
  char *buf = malloc(n + 1);
  if (!buf) return -1;
  if (n && read_all(fd, buf, n) < 0) {
    free(buf);
    return -1;
  }
  buf[n] = 0;
  *type = (char)hdr[0];
  *data = buf;
  *len = n;
  return 0;
}

static int consttime_eq(const char *a, size_t alen, const char *b, size_t blen) {
  unsigned char diff = alen != blen;
  for (size_t i = 0; i < alen && i < blen; i++) diff |= (unsigned char)(a[i] ^ b[i]);
  return diff == 0;
}

/* Splits the exec request into its NUL-terminated fields. */
static char **split_fields(char *data, uint32_t len, int *count) {
  int n = 0;
  for (uint32_t i = 0; i < len; i++)
    if (data[i] == 0) n++;
  char **out = calloc((size_t)n + 1, sizeof(char *));
  if (!out) return NULL;
  int k = 0;
  char *start = data;
  for (uint32_t i = 0; i < len; i++) {
    if (data[i] == 0) {
      out[k++] = start;
      start = data + i + 1;
    }
  }
  *count = n;
  return out;
}

static void serve(int sock) {
  char type;
  char *data;
  uint32_t len;
  if (recv_frame(sock, &type, &data, &len) < 0 || type != 'A' || !consttime_eq(data, len, token, token_len)) _exit(1);
  free(data);
  if (recv_frame(sock, &type, &data, &len) < 0 || type != 'X') _exit(1);
  int nf;
  char **f = split_fields(data, len, &nf);
  if (!f || nf < 1) _exit(1);
  int i = 0;
  int argc = atoi(f[i++]);
  if (argc < 1 || i + argc >= nf) _exit(1);
  char **argv = &f[i];
  i += argc;
  int envc = atoi(f[i]);
  f[i++] = NULL; /* terminates argv */
  if (envc < 0 || i + envc + 5 > nf) _exit(1);
  char **envp = calloc((size_t)envc + 1, sizeof(char *));
  for (int k = 0; k < envc; k++) envp[k] = f[i++];
  const char *cwd = f[i++];
  int tty = atoi(f[i++]);
  int rows = atoi(f[i++]);
  int cols = atoi(f[i++]);
  int want_stdin = atoi(f[i++]);

  int in_w = -1, out_r = -1, err_r = -1, master = -1;
  int in_p[2], out_p[2], err_p[2];
  pid_t pid;
  if (tty) {
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    pid = forkpty(&master, NULL, NULL, &ws);
  } else {
    if (pipe2(in_p, O_CLOEXEC) < 0 || pipe2(out_p, O_CLOEXEC) < 0 || pipe2(err_p, O_CLOEXEC) < 0) _exit(1);
    pid = fork();
  }
  if (pid < 0) _exit(1);
  if (pid == 0) {
    if (!tty) {
      setsid();
      dup2(in_p[0], 0);
      dup2(out_p[1], 1);
      dup2(err_p[1], 2);
    }
    signal(SIGPIPE, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    if (chdir(cwd) < 0) {
      dprintf(2, "fleet-guest-agent: cannot enter %s: %s\n", cwd, strerror(errno));
      _exit(127);
    }
    execvpe(argv[0], argv, envp);
    dprintf(2, "fleet-guest-agent: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  if (tty) {
    out_r = master;
    in_w = dup(master);
  } else {
    close(in_p[0]);
    close(out_p[1]);
    close(err_p[1]);
    in_w = in_p[1];
    out_r = out_p[0];
    err_r = err_p[0];
  }
  if (!want_stdin && !tty) {
    close(in_w);
    in_w = -1;
  }

  int status = 0, exited = 0;
  char buf[65536];
  /* Stdin the child has not taken yet: while any is pending the socket is not read (TCP pushes back on the
     host, and an EOF frame stays queued behind the data), and output keeps flowing, so a child that writes
     before it reads cannot deadlock the two. */
  char *pend = NULL;
  size_t pend_len = 0, pend_off = 0;
  if (in_w >= 0) fcntl(in_w, F_SETFL, fcntl(in_w, F_GETFL) | O_NONBLOCK);
  while (out_r >= 0 || err_r >= 0 || !exited) {
    int pending = pend != NULL;
    struct pollfd p[4] = {
        {pending ? -1 : sock, POLLIN, 0}, {out_r, POLLIN, 0}, {err_r, POLLIN, 0}, {pending ? in_w : -1, POLLOUT, 0}};
    int r = poll(p, 4, exited ? 200 : 50);
    if (r < 0 && errno != EINTR) break;
    if (!exited && waitpid(pid, &status, WNOHANG) == pid) exited = 1;
    if (pending && in_w >= 0) {
      ssize_t w = write(in_w, pend + pend_off, pend_len - pend_off);
      if (w > 0) pend_off += (size_t)w;
      if ((w < 0 && errno != EAGAIN && errno != EINTR) || pend_off == pend_len) {
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
          close(in_w);
          in_w = -1;
        }
        free(pend);
        pend = NULL;
      }
    } else if (pending) {
      free(pend);
      pend = NULL;
    }
    if (r > 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
      if (recv_frame(sock, &type, &data, &len) < 0) {
        kill(-pid, SIGKILL);
        _exit(0);
      }
      if (type == 'I' && in_w >= 0 && len > 0) {
        pend = data;
        pend_len = len;
        pend_off = 0;
        data = NULL;
      } else if (type == 'E' && in_w >= 0) {
        if (tty) {
          char eot = 4;
          write_all(in_w, &eot, 1);
        } else {
          close(in_w);
          in_w = -1;
        }
      } else if (type == 'S') {
        kill(-pid, atoi(data));
      } else if (type == 'R' && tty) {
        struct winsize ws = {0};
        int rr = 0, cc = 0;
        if (sscanf(data, "%d %d", &rr, &cc) == 2) {
          ws.ws_row = (unsigned short)rr;
          ws.ws_col = (unsigned short)cc;
          ioctl(master, TIOCSWINSZ, &ws);
        }
      }
      free(data);
    }
    for (int k = 1; k < 3; k++) {
      if (r <= 0 || p[k].fd < 0 || !(p[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = read(p[k].fd, buf, sizeof buf);
      if (n > 0) {
        if (send_frame(sock, k == 1 ? 'O' : 'e', buf, (uint32_t)n) < 0) {
          kill(-pid, SIGKILL);
          _exit(0);
        }
      } else if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        close(p[k].fd);
        if (k == 1) out_r = -1;
        else err_r = -1;
      }
    }
    if (tty && exited && out_r >= 0 && r == 0) {
      close(out_r);
      out_r = -1;
    }
  }
  if (!exited) waitpid(pid, &status, 0);
  char msg[64];
  if (WIFSIGNALED(status)) snprintf(msg, sizeof msg, "-1 %d", WTERMSIG(status));
  else snprintf(msg, sizeof msg, "%d 0", WEXITSTATUS(status));
  send_frame(sock, 'Z', msg, (uint32_t)strlen(msg));
  shutdown(sock, SHUT_WR);
  /* Wait for the host to close, so the exit frame is not lost to a reset. */
  while (read(sock, buf, sizeof buf) > 0) {
  }
  _exit(0);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: fleet-guest-agent PORT TOKEN_FILE\n");
    return 2;
  }
  token_path = argv[2];
  if (load_token() < 0) return 1;
  signal(SIGPIPE, SIG_IGN);
  signal(SIGCHLD, SIG_IGN); /* connection handlers are reaped by the kernel */
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1])), .sin_addr.s_addr = htonl(INADDR_ANY)};
  if (bind(ls, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(ls, 64) < 0) {
    perror("listen");
    return 1;
  }
  for (;;) {
    int s = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (s < 0) continue;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    pid_t h = fork();
    if (h == 0) {
      close(ls);
      signal(SIGCHLD, SIG_DFL);
      if (load_token() < 0) _exit(1);
      serve(s);
    }
    close(s);
  }
}
