"""The floor for a Python echo server: the smallest epoll loop that echoes raw bytes
(``epoll.poll``, ``recv_into`` a preallocated buffer, ``send`` a slice of it; locals only, no
layers, no batching, no limits).  Not a server to use -- a same-run yardstick for what CPython
itself costs per message, against which the aoprim server's layers are measured
(``python bench/echo_compare.py --floor``).  Raw framing only.  Run as a script (by path).

    python aoprim/benchmarks/echo_floor.py [--host 127.0.0.1] [--port 0]
"""
import argparse
import select
import socket


def serve(host, port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, port))
    ls.listen(1024)
    ls.setblocking(False)
    print("listening on %s:%d" % ls.getsockname()[:2], flush=True)
    ep = select.epoll()
    lfd = ls.fileno()
    ep.register(lfd, select.EPOLLIN)
    conns = {}
    mv = memoryview(bytearray(65536))
    poll = ep.poll
    while True:
        for fd, _ in poll():
            if fd == lfd:
                while True:
                    try:
                        c, _ = ls.accept()
                    except BlockingIOError:
                        break
                    c.setblocking(False)
                    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conns[c.fileno()] = (c, c.recv_into, c.send)
                    ep.register(c.fileno(), select.EPOLLIN)
                continue
            c, recv_into, send = conns[fd]
            try:
                n = recv_into(mv)
                if n:
                    send(mv[:n])     # loopback ping-pong: the reply always fits the buffer
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            ep.unregister(fd)
            del conns[fd]
            c.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--framing", default="raw", choices=["raw"])
    a = ap.parse_args()
    try:
        serve(a.host, a.port)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
