"""What ``Server(handler)`` accepts, and what it refuses at construction.

One rule, shared with the command line (``server.as_handler``): an object with callable
``on_connect``/``on_read``/``on_close`` is used as it is; a class with them (a ``Handler``
subclass) is instantiated with no arguments; anything else is a ``TypeError`` naming it.
The instance is checked: an ``on_read`` that is still ``Handler``'s do-nothing default (a
typo: ``on_reed``; a mixin listed after ``Handler``; the bare ``Handler``) would drop every
byte, and an ``async def`` or generator hook would never run its body, so ``Server()``
refuses either with a ``TypeError`` naming the class and the likely cause.
"""
import asyncio
import os
import socket

import pytest

from aoprim.server import Handler, Server, serve_protocol
from aoprim.server.loop import BACKENDS

from server_support import HOST, make_server, recv_exact  # noqa: F401


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The serving tests run on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


class Upper(Handler):
    def on_read(self, session, data):
        session.send(bytes(data).upper())


class Misspelt(Handler):
    def on_reed(self, session, data):         # the typo: on_read is Handler's do-nothing
        session.send(data)


class OnlyConnects(Handler):
    def on_connect(self, session):
        session.send(b"hello")


class NeedsArgs(Handler):
    def __init__(self, prefix):
        self.prefix = prefix

    def on_read(self, session, data):
        session.send(self.prefix + bytes(data))


class Duck:                  # not a Handler subclass, but it has the three hooks
    def on_connect(self, session):
        pass

    def on_read(self, session, data):
        session.send(b"quack:" + bytes(data))

    def on_close(self, session, exc):
        pass


class DuckTypo:
    def on_connect(self, session):
        pass

    def onread(self, session, data):
        pass

    def on_close(self, session, exc):
        pass


def make_upper():
    return Upper()


def _echo_once(srv, payload):
    with socket.create_connection(srv.address, timeout=10) as s:
        s.sendall(payload)
        return recv_exact(s, len(payload) + (6 if isinstance(srv.handler, Duck) else 0))


@pytest.mark.parametrize("given", [Upper, Upper()], ids=["class", "instance"])
def test_a_handler_class_is_instantiated_and_serves(make_server, given):
    srv = make_server(given)
    assert isinstance(srv.handler, Upper)
    assert given is Upper or srv.handler is given       # an instance is used as it is
    assert _echo_once(srv, b"shout") == b"SHOUT"


def test_a_class_with_the_hooks_is_instantiated_too(make_server):
    srv = make_server(Duck)
    assert type(srv.handler) is Duck
    assert _echo_once(srv, b"hi") == b"quack:hi"


def test_each_class_given_gets_its_own_instance():
    a, b = Server(Upper, HOST, 0), Server(Upper, HOST, 0)
    try:
        assert a.handler is not b.handler
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("given", [Misspelt, "instance"], ids=["class", "instance"])
def test_a_subclass_without_on_read_is_refused_naming_the_typo(given):
    with pytest.raises(TypeError) as info:
        Server(Misspelt if given is Misspelt else Misspelt(), HOST, 0)
    msg = str(info.value)
    assert "Misspelt does not define on_read" in msg
    assert "on_reed looks like a misspelt on_read" in msg
    assert "every byte" in msg


def test_the_refusal_is_at_server_construction_not_at_instantiation():
    h = OnlyConnects()              # a handler may be built first and completed later
    with pytest.raises(TypeError) as info:
        Server(h, HOST, 0)
    assert "OnlyConnects does not define on_read" in str(info.value)
    assert "looks like" not in str(info.value)      # no close name: no guess


class PerInstance(Handler):         # picks its on_read in __init__ (a strategy)
    def __init__(self, upper=True):
        self.on_read = self._upper if upper else self._echo

    def _echo(self, session, data):
        session.send(data)

    def _upper(self, session, data):
        session.send(bytes(data).upper())


@pytest.mark.parametrize("as_instance", [False, True], ids=["class", "instance"])
def test_an_on_read_set_per_instance_is_accepted_and_serves(make_server, as_instance):
    srv = make_server(PerInstance(upper=True) if as_instance else PerInstance)
    assert _echo_once(srv, b"quiet") == b"QUIET"


class EchoMixin:
    def on_read(self, session, data):
        session.send(data)


class MixinAfter(Handler, EchoMixin):
    pass


class MixinFirst(EchoMixin, Handler):
    pass


@pytest.mark.parametrize("as_instance", [False, True], ids=["class", "instance"])
def test_a_mixin_listed_after_handler_is_refused_naming_the_order(as_instance):
    with pytest.raises(TypeError) as info:
        Server(MixinAfter() if as_instance else MixinAfter, HOST, 0)
    msg = str(info.value)
    assert "Handler's default on_read shadows EchoMixin.on_read" in msg
    assert "list EchoMixin before Handler" in msg
    assert "misspelt" not in msg


def test_a_mixin_listed_before_handler_serves(make_server):
    srv = make_server(MixinFirst)
    assert _echo_once(srv, b"mix") == b"mix"


@pytest.mark.parametrize("given", [Handler, Handler()], ids=["class", "instance"])
def test_the_base_handler_itself_is_refused(given):
    with pytest.raises(TypeError) as info:
        Server(given, HOST, 0)
    msg = str(info.value)
    assert "the base class Handler itself drops every byte" in msg
    assert "subclass" in msg


class AsyncRead(Handler):
    async def on_read(self, session, data):
        session.send(data)


class GeneratorRead(Handler):
    def on_read(self, session, data):
        yield session.send(data)


class AsyncGeneratorConnect(Upper):
    async def on_connect(self, session):
        yield


class AsyncClose(Upper):
    async def on_close(self, session, exc):
        pass


class AsyncPerInstance(Handler):
    def __init__(self):
        self.on_read = self._read

    async def _read(self, session, data):
        pass


@pytest.mark.parametrize("cls, hook, kind", [
    (AsyncRead, "on_read", "a coroutine function (async def)"),
    (GeneratorRead, "on_read", "a generator function"),
    (AsyncGeneratorConnect, "on_connect", "an async generator function"),
    (AsyncClose, "on_close", "a coroutine function (async def)"),
    (AsyncPerInstance, "on_read", "a coroutine function (async def)"),
])
@pytest.mark.parametrize("as_instance", [False, True], ids=["class", "instance"])
def test_a_hook_that_is_not_a_plain_function_is_refused(cls, hook, kind, as_instance):
    with pytest.raises(TypeError) as info:
        Server(cls() if as_instance else cls, HOST, 0)
    msg = str(info.value)
    assert f"{cls.__qualname__}.{hook} is {kind}" in msg
    assert "serve_protocol" in msg and "aoprim.aio" in msg


class CloseWithoutReason(Handler):
    def on_read(self, session, data):
        pass

    def on_close(self, session):        # (the reason is missing)
        pass


class ReadWithExtraArgument(Handler):
    def on_read(self, session, data, when):
        pass


class ConnectTakesNothing:
    def on_connect(self):
        pass

    def on_read(self, session, data):
        pass

    def on_close(self, session, reason):
        pass


class FlexibleHooks(Handler):
    def on_connect(self, *args):
        pass

    def on_read(self, session, data, extra=None, **kw):
        pass

    def on_close(self, session, reason=None):
        pass


@pytest.mark.parametrize("cls, hook, wants", [
    (CloseWithoutReason, "on_close", "(session, reason)"),
    (ReadWithExtraArgument, "on_read", "(session, data)"),
    (ConnectTakesNothing, "on_connect", "(session)"),
])
def test_a_hook_that_cannot_take_the_servers_arguments_is_refused_at_construction(
        cls, hook, wants):
    """Found when the server is built, as a missing on_read is -- not as a TypeError
    logged at every close or read."""
    with pytest.raises(TypeError) as info:
        Server(cls(), HOST, 0)
    msg = str(info.value)
    assert msg.startswith(f"{cls.__qualname__}.{hook}(") and wants in msg, msg


def test_hooks_with_defaults_or_star_args_are_taken():
    srv = Server(FlexibleHooks(), HOST, 0)
    srv.shutdown()


def test_a_subclass_of_a_subclass_inherits_on_read():
    class Louder(Upper):
        def on_connect(self, session):
            pass

    srv = Server(Louder, HOST, 0)
    try:
        assert isinstance(srv.handler, Upper)
    finally:
        srv.shutdown()


def test_arguments_to_a_class_without_init_are_still_refused():
    with pytest.raises(TypeError, match=r"Upper\(\) takes no arguments"):
        Upper(1)
    assert NeedsArgs(b">").prefix == b">"


class Configured:
    def __init__(self, cfg, *, level=0):
        self.cfg = cfg


class NeedsArgsInMixin(Handler, Configured):
    def on_read(self, session, data):
        pass


@pytest.mark.parametrize("cls, sig", [(NeedsArgs, "(prefix)"),
                                      (NeedsArgsInMixin, "(cfg, *, level=0)")])
def test_a_class_that_needs_arguments_is_refused_by_name(cls, sig):
    with pytest.raises(TypeError) as info:
        Server(cls, HOST, 0)
    name = cls.__qualname__
    assert str(info.value) == (f"Server() instantiates a handler class with no arguments; "
                               f"{name} needs arguments {sig}: pass an instance, "
                               f"Server({name}(...))")


@pytest.mark.parametrize("given, words", [
    (DuckTypo, ["class DuckTypo has no callable on_read", "onread looks like a misspelt"]),
    (DuckTypo(), ["object of type DuckTypo has no callable on_read", "onread looks like"]),
    (make_upper, ["make_upper is a function, not a handler", "Server(make_upper(), ...)"]),
    (object(), ["object of type object has no callable on_connect, on_read, on_close"]),
    (42, ["object of type int has no callable"]),
])
def test_anything_without_the_hooks_is_refused_naming_it(given, words):
    with pytest.raises(TypeError) as info:
        Server(given, HOST, 0)
    for w in words:
        assert w in str(info.value)


def test_a_refused_handler_takes_no_resources():
    before = sorted(os.listdir("/proc/self/fd"))
    for given in (Misspelt, NeedsArgs, DuckTypo, make_upper, Handler, AsyncRead, MixinAfter):
        with pytest.raises(TypeError):
            Server(given, HOST, 0)
    assert sorted(os.listdir("/proc/self/fd")) == before


class EchoProtocol(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(data)


@pytest.mark.parametrize("given, words", [
    (Upper, ["serve_protocol() takes an asyncio protocol factory; Upper is an aoprim "
             "Handler: serve it with Server(Upper, ...)"]),
    (Upper(), ["Upper is an aoprim Handler"]),
    (EchoProtocol(), ["not a protocol instance of type EchoProtocol", "pass a class"]),
    (asyncio.Protocol(), ["not a protocol instance of type Protocol"]),
    (42, ["not an object of type int"]),
])
def test_serve_protocol_refuses_what_is_not_a_protocol_factory(given, words):
    before = sorted(os.listdir("/proc/self/fd"))
    for backend in BACKENDS:
        with pytest.raises(TypeError) as info:
            serve_protocol(given, HOST, 0, backend=backend)
        for w in words:
            assert w in str(info.value)
    assert sorted(os.listdir("/proc/self/fd")) == before        # refused before any socket


@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_protocol_still_takes_a_class_or_a_function(backend):
    for factory in (EchoProtocol, lambda: EchoProtocol()):
        srv = serve_protocol(factory, HOST, 0, backend=backend)
        try:
            with socket.create_connection(srv.address, timeout=10) as s:
                s.sendall(b"proto")
                assert recv_exact(s, 5) == b"proto"
        finally:
            srv.shutdown()
