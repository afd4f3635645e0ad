/* faultinject.c -- an LD_PRELOAD shim that injects socket faults under the server's Layer 2.
 *
 * Built at test time by tests/server/test_faults.py:
 *     gcc -shared -fPIC -O2 -o faultinject.so faultinject.c -ldl
 * and loaded into a server subprocess with LD_PRELOAD.  Never committed as a binary.
 *
 * It wraps recv, recvfrom, read, send, sendmsg, write, writev, accept and accept4 (the real
 * ones found with dlsym(RTLD_NEXT)).  A call is a candidate only if its fd is a socket
 * (fstat: S_ISSOCK) bound to the port AOP_FAULT_PORT (getsockname): the listening socket and
 * every connection accepted from it.  Everything else -- files, pipes, the loop's wake-up
 * socketpair -- passes straight through, as does every call while AOP_FAULT_PORT is unset.
 *
 * Environment (rates are probabilities per candidate call, 0..1):
 *   AOP_FAULT_PORT     the server's port (required to inject anything)
 *   AOP_FAULT_SEED     seed of the per-thread generators (default 1)
 *   AOP_FAULT_EINTR    fail with EINTR before doing anything          (default 0.02)
 *   AOP_FAULT_EAGAIN   fail with EAGAIN before doing anything         (default 0.02)
 *   AOP_FAULT_SHORT    read or write fewer bytes than asked           (default 0.2)
 *   AOP_FAULT_KILL     fail with ECONNRESET (reads), EPIPE/ECONNRESET/ENOBUFS (writes)
 *                      -- the connection may die                      (default 0.0005)
 *   AOP_FAULT_ACCEPT   accept fails with EINTR/EAGAIN/ECONNABORTED/EMFILE (default 0.05)
 *   AOP_FAULT_REPORT   a path: at exit, the injected-fault counts are written there
 *
 * EINTR/EAGAIN/short are "always" faults: a correct server survives them with every byte
 * intact.  Kill faults return an error but leave the kernel socket alone; the server must
 * then close that connection and return its resources.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define AOP_MAX_IOV 1024

typedef ssize_t (*recv_fn)(int, void *, size_t, int);
typedef ssize_t (*recvfrom_fn)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
typedef ssize_t (*read_fn)(int, void *, size_t);
typedef ssize_t (*send_fn)(int, const void *, size_t, int);
typedef ssize_t (*sendmsg_fn)(int, const struct msghdr *, int);
typedef ssize_t (*write_fn)(int, const void *, size_t);
typedef ssize_t (*writev_fn)(int, const struct iovec *, int);
typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*accept4_fn)(int, struct sockaddr *, socklen_t *, int);

static recv_fn real_recv;
static recvfrom_fn real_recvfrom;
static read_fn real_read;
static send_fn real_send;
static sendmsg_fn real_sendmsg;
static write_fn real_write;
static writev_fn real_writev;
static accept_fn real_accept;
static accept4_fn real_accept4;

static int aop_port;                    /* 0: inject nothing */
static uint64_t aop_seed = 1;
static double r_eintr = 0.02, r_eagain = 0.02, r_short = 0.2, r_kill = 0.0005,
              r_accept = 0.05;
static const char *aop_report;

/* counters (relaxed atomics: totals only) */
static uint64_t n_eintr, n_eagain, n_short, n_kill, n_accept, n_calls;
static uint64_t aop_thread_seq;

static __thread uint64_t rng_state;

static void count(uint64_t *c) { __atomic_fetch_add(c, 1, __ATOMIC_RELAXED); }

static uint64_t rnd(void)
{
    if (rng_state == 0) {       /* per-thread stream: the seed and the thread's order */
        uint64_t k = __atomic_add_fetch(&aop_thread_seq, 1, __ATOMIC_RELAXED);
        rng_state = (aop_seed * 0x9E3779B97F4A7C15ULL) ^ (k * 0xBF58476D1CE4E5B9ULL) ^ 1;
    }
    /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}

static double chance(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

static double env_rate(const char *name, double dflt)
{
    const char *v = getenv(name);
    return v && *v ? atof(v) : dflt;
}

__attribute__((constructor)) static void aop_init(void)
{
    real_recv = (recv_fn)dlsym(RTLD_NEXT, "recv");
    real_recvfrom = (recvfrom_fn)dlsym(RTLD_NEXT, "recvfrom");
    real_read = (read_fn)dlsym(RTLD_NEXT, "read");
    real_send = (send_fn)dlsym(RTLD_NEXT, "send");
    real_sendmsg = (sendmsg_fn)dlsym(RTLD_NEXT, "sendmsg");
    real_write = (write_fn)dlsym(RTLD_NEXT, "write");
    real_writev = (writev_fn)dlsym(RTLD_NEXT, "writev");
    real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
    real_accept4 = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
    const char *p = getenv("AOP_FAULT_PORT");
    aop_port = p ? atoi(p) : 0;
    const char *s = getenv("AOP_FAULT_SEED");
    aop_seed = s ? strtoull(s, NULL, 10) : 1;
    r_eintr = env_rate("AOP_FAULT_EINTR", r_eintr);
    r_eagain = env_rate("AOP_FAULT_EAGAIN", r_eagain);
    r_short = env_rate("AOP_FAULT_SHORT", r_short);
    r_kill = env_rate("AOP_FAULT_KILL", r_kill);
    r_accept = env_rate("AOP_FAULT_ACCEPT", r_accept);
    aop_report = getenv("AOP_FAULT_REPORT");
}

__attribute__((destructor)) static void aop_fini(void)
{
    if (!aop_report || !*aop_report || !real_write)
        return;
    int fd = open(aop_report, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    char buf[256];
    int n = snprintf(buf, sizeof buf,
                     "{\"calls\": %llu, \"eintr\": %llu, \"eagain\": %llu, \"short\": %llu, "
                     "\"kill\": %llu, \"accept\": %llu}\n",
                     (unsigned long long)n_calls, (unsigned long long)n_eintr,
                     (unsigned long long)n_eagain, (unsigned long long)n_short,
                     (unsigned long long)n_kill, (unsigned long long)n_accept);
    if (n > 0)
        real_write(fd, buf, (size_t)n);
    close(fd);
}

/* Is fd a socket bound to the server's port? */
static int targeted(int fd)
{
    if (aop_port == 0 || fd < 0)
        return 0;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode))
        return 0;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0)
        return 0;
    int port;
    if (ss.ss_family == AF_INET)
        port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    else if (ss.ss_family == AF_INET6)
        port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    else
        return 0;
    return port == aop_port;
}

/* The fault for one call: 0 none, or an errno to fail with (before any I/O).  *shorten is
 * set when the call should move fewer bytes than asked. */
static int pick(int writing, int *shorten)
{
    count(&n_calls);
    *shorten = 0;
    double x = chance();
    if (x < r_kill) {
        count(&n_kill);
        if (!writing)
            return ECONNRESET;
        switch (rnd() % 3) {
        case 0: return EPIPE;
        case 1: return ECONNRESET;
        default: return ENOBUFS;
        }
    }
    x -= r_kill;
    if (x < r_eintr) {
        count(&n_eintr);
        return EINTR;
    }
    x -= r_eintr;
    if (x < r_eagain) {
        count(&n_eagain);
        return EAGAIN;
    }
    x -= r_eagain;
    if (x < r_short)
        *shorten = 1;
    return 0;
}

static size_t shorter(size_t n)
{
    if (n <= 1)
        return n;
    count(&n_short);
    return 1 + (size_t)(rnd() % (n - 1));       /* 1 .. n-1 */
}

/* One call on fd moving n bytes: -1 with errno set when it must fail (before any I/O), else
 * 0, with *n made shorter when the call should move fewer bytes than asked. */
static int inject(int fd, int writing, size_t *n)
{
    int sh;
    if (!targeted(fd))
        return 0;
    int e = pick(writing, &sh);
    if (e) {
        errno = e;
        return -1;
    }
    if (sh)
        *n = shorter(*n);
    return 0;
}

ssize_t recv(int fd, void *buf, size_t n, int flags)
{
    if (inject(fd, 0, &n) < 0)
        return -1;
    return real_recv(fd, buf, n, flags);
}

ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *a, socklen_t *al)
{
    if (inject(fd, 0, &n) < 0)
        return -1;
    return real_recvfrom(fd, buf, n, flags, a, al);
}

ssize_t read(int fd, void *buf, size_t n)
{
    if (inject(fd, 0, &n) < 0)
        return -1;
    return real_read(fd, buf, n);
}

ssize_t send(int fd, const void *buf, size_t n, int flags)
{
    if (inject(fd, 1, &n) < 0)
        return -1;
    return real_send(fd, buf, n, flags);
}

ssize_t write(int fd, const void *buf, size_t n)
{
    if (inject(fd, 1, &n) < 0)
        return -1;
    return real_write(fd, buf, n);
}

/* Copy at most ``keep`` bytes' worth of ``iov`` into ``out``; returns the segment count. */
static int cut_iov(const struct iovec *iov, int cnt, size_t keep, struct iovec *out)
{
    int k = 0;
    for (int i = 0; i < cnt && keep > 0 && k < AOP_MAX_IOV; i++) {
        size_t l = iov[i].iov_len < keep ? iov[i].iov_len : keep;
        if (l == 0)
            continue;
        out[k].iov_base = iov[i].iov_base;
        out[k].iov_len = l;
        keep -= l;
        k++;
    }
    return k;
}

static size_t iov_total(const struct iovec *iov, int cnt)
{
    size_t t = 0;
    for (int i = 0; i < cnt; i++)
        t += iov[i].iov_len;
    return t;
}

/* inject() for a gathered write of cnt segments: -1 with errno set (fail), 0 (write iov as
 * it is), or k > 0: write the k segments put in tmp (fewer bytes than asked). */
static int inject_iov(int fd, const struct iovec *iov, size_t cnt, struct iovec *tmp)
{
    int sh;
    if (!targeted(fd))
        return 0;
    int e = pick(1, &sh);
    if (e) {
        errno = e;
        return -1;
    }
    if (sh && cnt > 0 && cnt <= AOP_MAX_IOV) {
        size_t total = iov_total(iov, (int)cnt);
        if (total > 1)
            return cut_iov(iov, (int)cnt, shorter(total), tmp);
    }
    return 0;
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
    struct iovec tmp[AOP_MAX_IOV];
    int k = inject_iov(fd, msg->msg_iov, msg->msg_iovlen, tmp);
    if (k < 0)
        return -1;
    if (k > 0) {
        struct msghdr m = *msg;
        m.msg_iov = tmp;
        m.msg_iovlen = (size_t)k;
        return real_sendmsg(fd, &m, flags);
    }
    return real_sendmsg(fd, msg, flags);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    struct iovec tmp[AOP_MAX_IOV];
    int k = inject_iov(fd, iov, cnt > 0 ? (size_t)cnt : 0, tmp);
    if (k < 0)
        return -1;
    if (k > 0)
        return real_writev(fd, tmp, k);
    return real_writev(fd, iov, cnt);
}

static int accept_fault(void)
{
    if (chance() >= r_accept)
        return 0;
    count(&n_accept);
    switch (rnd() % 4) {
    case 0: return EINTR;
    case 1: return EAGAIN;
    case 2: return ECONNABORTED;
    default: return EMFILE;
    }
}

/* accept_fault() on the server's listening socket: -1 with errno set, else 0. */
static int inject_accept(int fd)
{
    if (!targeted(fd))
        return 0;
    int e = accept_fault();
    if (e) {
        errno = e;
        return -1;
    }
    return 0;
}

int accept(int fd, struct sockaddr *a, socklen_t *al)
{
    if (inject_accept(fd) < 0)
        return -1;
    return real_accept(fd, a, al);
}

int accept4(int fd, struct sockaddr *a, socklen_t *al, int flags)
{
    if (inject_accept(fd) < 0)
        return -1;
    return real_accept4(fd, a, al, flags);
}
