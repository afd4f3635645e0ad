"""aoprim.aio and the end of a process in the middle of a callback (docs/aio.md, "What a
peer or a caller can observe that differs from asyncio").

- ``os.fork()`` after a ``write()`` in the same callback: the bytes are still in the loop's
  batch, so the forked child holds a copy of them.  The child drops what it inherited
  (``os.register_at_fork``): the peer gets them once, from the parent, as on asyncio;
  what the child itself writes after the fork is sent.
- ``os._exit()`` or ``os.execv()`` right after a ``write()`` in the same callback: the bytes
  were never handed to the kernel and are lost (asyncio's ``write()`` tries the socket at
  once); ``transport.get_write_buffer_size()`` before it hands them to the kernel.

Each case runs in a subprocess of its own (a fork of the test process is not wanted) and
prints what the peer received.
"""
import subprocess
import sys

import pytest

from proc_support import NEUTRAL_CWD, child_env

FORK = r"""
import asyncio, os, socket, sys
import aoprim.aio

async def main():
    loop = asyncio.get_running_loop()
    a, peer = socket.socketpair()
    t, _ = await loop.create_connection(asyncio.Protocol, sock=a)
    t.write(b"PARENT;")                   # still in the loop's batch at the fork
    pid = os.fork()
    if pid == 0:
        peer.close()
        t.write(b"CHILD;")                # the child's own write: sent
        sys.exit(0)                       # out of the loop, which flushes on the way
    os.waitpid(pid, 0)                    # the child is gone before the parent flushes
    await asyncio.sleep(0)
    t.close()                             # the parent's last copy of the socket
    a.close()
    got = b""
    while (x := peer.recv(1000)):         # until EOF: every holder of the socket closed it
        got += x
    print(repr(got))

try:
    aoprim.aio.new_event_loop().run_until_complete(main())
except SystemExit:
    pass
"""

ENDS = r"""
import asyncio, os, socket, sys
import aoprim.aio

how, remedy = sys.argv[1], sys.argv[2]
a, peer = socket.socketpair()
pid = os.fork()
if pid:                                   # the peer: what arrives before EOF
    a.close()
    got = b""
    while (x := peer.recv(1000)):
        got += x
    os.waitpid(pid, 0)
    print(repr(got))
    sys.exit(0)
peer.close()

def end():
    if how == "exit":
        os._exit(0)
    os.execv("/bin/true", ["true"])

class Reply(asyncio.Protocol):
    def connection_made(self, t):
        t.write(b"bye\n")
        if remedy == "next":                    # from the next iteration's callback
            asyncio.get_running_loop().call_soon(end)
            return
        if remedy == "flush":
            left = t.get_write_buffer_size()    # hands the batch to the kernel now
            assert left == 0, left
        end()

async def main():
    await asyncio.get_running_loop().connect_accepted_socket(Reply, a)
    await asyncio.sleep(60)

aoprim.aio.new_event_loop().run_until_complete(main())
"""


def run(source, *args):
    p = subprocess.run([sys.executable, "-c", source, *args], capture_output=True,
                       text=True, timeout=60, cwd=NEUTRAL_CWD, env=child_env())
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


@pytest.mark.timeout(90)
def test_a_forked_child_does_not_send_the_parent_s_batched_writes_again():
    """The child inherited the batch and sent it again on its way out (the peer got the
    parent's bytes twice)."""
    assert run(FORK) == repr(b"CHILD;PARENT;")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["exit", "exec"])
def test_a_write_before_the_process_ends_in_the_same_callback_is_lost(how):
    """Documented: the batch leaves at the end of the iteration, which never comes."""
    assert run(ENDS, how, "none") == repr(b"")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("remedy", ["flush", "next"])
@pytest.mark.parametrize("how", ["exit", "exec"])
def test_the_write_arrives_when_handed_over_before_the_end(how, remedy):
    """``get_write_buffer_size()`` hands the batch to the kernel; ending the process from
    the next callback lets the iteration's end do it."""
    assert run(ENDS, how, remedy) == repr(b"bye\n")


RAW = r"""
import asyncio, os, socket, sys
import aoprim.aio

async def main():
    loop = asyncio.get_running_loop()
    a, peer = socket.socketpair()
    t, _ = await loop.create_connection(asyncio.Protocol, sock=a)
    t.write(b"A")
    if sys.argv[1] == "flush":
        t.get_write_buffer_size()
    os.write(t.get_extra_info("socket").fileno(), b"D")
    await asyncio.sleep(0)
    t.close()
    await asyncio.sleep(0)
    got = b""
    while (x := peer.recv(1000)):
        got += x
    print(repr(got))

aoprim.aio.new_event_loop().run_until_complete(main())
"""


@pytest.mark.timeout(90)
def test_raw_fd_bytes_overtake_the_batched_write_of_the_same_callback():
    """Documented: what ``write()`` batched leaves at the iteration's end, after them."""
    assert run(RAW, "none") == repr(b"DA")


@pytest.mark.timeout(90)
def test_get_write_buffer_size_keeps_the_order_of_a_raw_fd_write():
    assert run(RAW, "flush") == repr(b"AD")
