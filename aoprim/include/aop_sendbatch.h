/*
 * aop_sendbatch.h -- the one write system call behind SendBatch (aoprim/_sendbatch.pyx).
 *
 * aop_sb_write() issues exactly one system call for `cnt` iovec segments and never retries:
 * retrying (EINTR), switching from sockets to plain fds (ENOTSOCK) and cursor advance are the
 * caller's job, because only the caller knows whether it may check signals (GIL held) or not.
 *
 *   socket fd, 1 segment   -> send(fd, base, len, MSG_NOSIGNAL)
 *   socket fd, >1 segments -> sendmsg(fd, {iov, cnt}, MSG_NOSIGNAL)
 *   other fd,  1 segment   -> write(fd, base, len)
 *   other fd,  >1 segments -> writev(fd, iov, cnt)
 *
 * send()/write() for the single-segment case (the common one: coalesced small messages form
 * one segment) skip the kernel's msghdr/iovec import; they are the same one system call.
 * MSG_NOSIGNAL makes a closed peer give EPIPE instead of raising SIGPIPE.  (Python ignores
 * SIGPIPE at start-up, so write()/writev() on a pipe also get EPIPE.)
 *
 * Returns the number of bytes written (>= 0) or -errno.  Usable without the GIL.
 */
#ifndef AOP_SENDBATCH_H
#define AOP_SENDBATCH_H


#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a module that does not call it
 * (no -Wunused-function warning in a cimporting extension). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include <sys/types.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <limits.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
/* most segments one call may carry (Linux: 1024) */
#define AOP_SB_IOV_MAX IOV_MAX

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

/* EAGAIN and EWOULDBLOCK may or may not be the same number: test both, in C. */
AOP_FUNC inline int aop_sb_would_block(int e) { return e == EAGAIN || e == EWOULDBLOCK; }

/* aop_sb_write with extra send flags for sockets (MSG_DONTWAIT: never block, whatever the
 * fd's mode); `flags` is ignored for write()/writev(). */
AOP_FUNC inline ssize_t aop_sb_write_flags(int fd, struct iovec *iov, int cnt, int is_sock,
                                         int flags)
{
    ssize_t n;
    if (is_sock) {
        if (cnt == 1) {
            n = send(fd, iov[0].iov_base, iov[0].iov_len, MSG_NOSIGNAL | flags);
        } else {
            struct msghdr m;
            memset(&m, 0, sizeof m);
            m.msg_iov = iov;
            m.msg_iovlen = (size_t)cnt;
            n = sendmsg(fd, &m, MSG_NOSIGNAL | flags);
        }
    } else {
        n = (cnt == 1) ? write(fd, iov[0].iov_base, iov[0].iov_len) : writev(fd, iov, cnt);
    }
    return n < 0 ? -(ssize_t)errno : n;
}

AOP_FUNC inline ssize_t aop_sb_write(int fd, struct iovec *iov, int cnt, int is_sock)
{
    return aop_sb_write_flags(fd, iov, cnt, is_sock, 0);
}

#endif /* AOP_SENDBATCH_H */
