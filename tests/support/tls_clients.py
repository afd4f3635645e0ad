"""TLS clients for the server's TLS tests (no tests in here): a ClientHello made through a
MemoryBIO, a client that controls its own records (``RawTLS``), and ``openssl s_client`` in a
child process (``SClient``).

Import as ``from tls_clients import ...`` (conftest puts tests/ on sys.path).
"""
import queue
import socket
import ssl
import subprocess
import threading
import time

from proc_support import NEUTRAL_CWD


def client_hello(ctx):
    """The bytes a client sends first (its ClientHello), made through a MemoryBIO."""
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname="localhost")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        return out.read()
    raise AssertionError("a client handshake completed without a server")


class RawTLS:
    """A TLS client over a plain socket through MemoryBIOs: it can send what it likes of
    its own records (half of one, a corrupted one) after a real handshake."""

    def __init__(self, address, ctx):
        self.sock = socket.create_connection(address, timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inc, self.out, server_hostname="localhost")

    def handshake(self, prefix=b"", trickle=False):
        """Complete the handshake.  ``prefix`` (a PROXY header, say) goes out in front of
        the ClientHello, in the same send; ``trickle``: every byte of the client's first
        flight in its own send instead."""
        first = True
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                out = self.out.read()
                if first:
                    out, first = prefix + out, False
                    if trickle:
                        for i in range(len(out)):
                            self.sock.send(out[i:i + 1])
                        out = b""
                self.sock.sendall(out)
                data = self.sock.recv(1 << 16)
                if not data:
                    raise ConnectionError("closed during the handshake")
                self.inc.write(data)
        self.sock.sendall(self.out.read())
        return self

    def echo(self, payload):
        """One u16 frame out, its echo back (decrypted); returns the echoed payload."""
        msg = len(payload).to_bytes(2, "big") + payload
        self.sock.sendall(self.record(msg))
        got = bytearray()
        while len(got) < len(msg):
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("closed before the echo")
            got += self.plaintext(chunk)
        return bytes(got[2:])

    def record(self, data):
        """``data`` encrypted as this connection's next record(s), not sent."""
        self.obj.write(data)
        return self.out.read()

    def plaintext(self, data):
        """What ``data`` (bytes from the server) decrypts to, up to the first error."""
        self.inc.write(data)
        got = bytearray()
        while True:
            try:
                chunk = self.obj.read(1 << 16)
            except (ssl.SSLError, ValueError):
                break
            if not chunk:
                break
            got += chunk
        return bytes(got)


class SClient:
    """``openssl s_client`` in a child process (interactive mode: its ``R`` command
    renegotiates); stdout lines are collected by a thread."""

    def __init__(self, address, args):
        self.p = subprocess.Popen(
            ["openssl", "s_client", "-connect", f"{address[0]}:{address[1]}", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=NEUTRAL_CWD)
        self.lines = queue.Queue()
        self.all = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, text):
        self.p.stdin.write(text)
        self.p.stdin.flush()

    def wait_line(self, want, timeout=10.0):
        """True once a stdout line equal to ``want`` (stripped) arrives; False at EOF or
        timeout."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:
                self.lines.put(None)
                return False
            self.all.append(line)
            if line.decode(errors="replace").strip() == want:
                return True

    def finish(self, timeout=10.0):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.t.join(5)
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.all.append(line)
        self.p.stdout.close()
        return b"".join(self.all).decode(errors="replace")
