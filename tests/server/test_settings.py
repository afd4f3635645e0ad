"""Settings: every setting is checked when the Settings (and so the Server) is built, against
the range the code can really hold -- just inside each bound is accepted, just outside is
refused with an error naming the setting, the value and the range -- so nothing fails
later, at start() or on the first connection."""
import math
import os
import socket
import sys
import threading

import pytest

from aoprim.server import Server
from aoprim.server.apps import Echo
from aoprim.server.config import Settings, _cgroup_pids_max

from server_support import HOST, read_frame, frame, make_server  # noqa: F401


def physical_memory():
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_threads():
    """The threads this process may start, as the OS says (None: no limit known)."""
    import resource
    limits = []
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    try:
        with open("/proc/sys/kernel/threads-max") as f:
            limits.append(int(f.read()))
    except OSError:
        pass
    pids = _cgroup_pids_max()     # (its own test below)
    if pids is not None:
        limits.append(pids)
    return min(limits) if limits else None


@pytest.mark.parametrize("cgroup, files, expected", [
    # v2: the smallest pids.max from the process's own group up ("max": none there)
    ("0::/system.slice/app.service\n",
     {"system.slice/app.service/pids.max": "max", "system.slice/pids.max": "40"}, 40),
    ("0::/a/b\n", {"a/b/pids.max": "12", "a/pids.max": "30"}, 12),
    ("0::/a/b\n", {"a/b/pids.max": "max"}, None),
    ("0::/\n", {}, None),
    # a cgroup namespace (a container): the group is the mount's top, whose pids.max counts
    ("0::/\n", {"pids.max": "40"}, 40),
    ("8:pids:/\n", {"pids/pids.max": "33"}, 33),
    # v1: the pids controller's own hierarchy, wherever its line is
    ("12:pids:/docker/x\n0::/docker/x\n", {"pids/docker/x/pids.max": "25",
                                             "docker/x/pids.max": "7"}, 25),
    ("4:memory:/m\n", {}, None),
    ("not a cgroup file\n", {}, None),
])
def test_the_workers_bound_reads_a_pids_cgroup(tmp_path, cgroup, files, expected):
    (tmp_path / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        f = tmp_path / "fs" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    assert _cgroup_pids_max(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == expected


# setting -> (lowest, highest or None: no upper bound).  Each upper bound is a limit of the
# code: a C type (Py_ssize_t byte counts, listen()'s int), SlabPool's most slots, the
# completion queue's largest capacity, the PROXY header format, rx_reads' burst.
SSIZE_MAX = sys.maxsize
INT_BOUNDS = {
    "max_frame": (1, None),
    "max_connections": (1, None),
    "max_pending": (1, None),
    "flush_budget": (1, 2 ** 62),
    "backlog": (0, 2 ** 31 - 1),
    "rx_slot_size": (64, None),
    "rx_slots": (2, 2 ** 30),
    "rx_reads": (1, 1024),
    "rx_read_size": (0, 2 ** 30),
    "rx_read_slots": (2, 2 ** 30),
    "rx_frame_cache": (0, SSIZE_MAX),
    "tx_slot_size": (64, None),
    "tx_slots": (1, 2 ** 30),
    "worker_backlog": (1, None),
    "worker_queue": (1, 2 ** 32),
    "accept_batch": (1, None),
    "proxy_max_header": (232, 16 + 65535),
    "high_water": (1, None),
    "workers": (0, max_threads()),
}
# settings whose only cost at the upper bound is memory: checked with the smallest partner
# (the other factor of the pool) so that the memory check does not decide first
SMALL_PARTNER = {
    "rx_slots": {"rx_slot_size": 64},
    "tx_slots": {"tx_slot_size": 64},
    "rx_read_slots": {"rx_read_size": 0},
    "worker_queue": {"workers": 0},
}


def test_every_int_setting_has_its_bounds_listed_here():
    ints = {f.name for f in Settings.__dataclass_fields__.values()
            if f.type in ("int", "int | None")}
    assert ints - {"low_water"} == set(INT_BOUNDS)


@pytest.mark.parametrize("name", sorted(INT_BOUNDS))
def test_lower_bound(name):
    lo, _ = INT_BOUNDS[name]
    assert getattr(Settings(**{name: lo}), name) == lo
    with pytest.raises(ValueError) as e:
        Settings(**{name: lo - 1})
    msg = str(e.value)
    assert name in msg and str(lo - 1) in msg and str(lo) in msg


@pytest.mark.parametrize("name", sorted(n for n, (_, hi) in INT_BOUNDS.items()
                                        if hi is not None))
def test_upper_bound(name):
    lo, hi = INT_BOUNDS[name]
    kw = SMALL_PARTNER.get(name, {})
    inside = {name: hi, **kw}
    mem = physical_memory()
    pools = {"rx_slots": hi * 64 + 256 * 16384, "tx_slots": 1024 * 16384 + hi * 64}
    if pools.get(name, 0) > mem:
        # the range allows it, this machine's memory does not: refused for that reason
        with pytest.raises(ValueError, match="physical memory"):
            Settings(**inside)
    else:
        assert getattr(Settings(**inside), name) == hi
    with pytest.raises(ValueError) as e:
        Settings(**{**kw, name: hi + 1})
    msg = str(e.value)
    assert f"{name} must be in {lo}..{hi}" in msg and msg.endswith(f"not {hi + 1}")


@pytest.mark.parametrize("name", sorted(n for n, (_, hi) in INT_BOUNDS.items() if hi is None))
def test_no_upper_bound_where_any_size_is_handled(name):
    # a limit compared with counts, or a pool's slot size (bounded by memory instead)
    v = 2 ** 100 if name not in ("rx_slot_size", "tx_slot_size") else 1 << 20
    assert getattr(Settings(**{name: v}), name) == v


@pytest.mark.parametrize("name", sorted(INT_BOUNDS) + ["low_water"])
@pytest.mark.parametrize("bad", [1.0, "8", True])
def test_int_settings_refuse_other_types_by_name(name, bad):
    with pytest.raises(TypeError, match=f"^{name} must be an int.*not {type(bad).__name__}$"):
        Settings(**{name: bad})


def test_reuse_port_is_a_bool():
    assert Settings(reuse_port=True).reuse_port is True
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match=f"^reuse_port must be True or False, not "
                                            f"{type(bad).__name__}$"):
            Settings(reuse_port=bad)


def test_low_water_above_high_water():
    assert Settings(high_water=100, low_water=100).low_water == 100
    with pytest.raises(ValueError, match=r"low_water must be <= high_water \(100\), not 101"):
        Settings(high_water=100, low_water=101)


# -- memory: each pool, and all of them together, within physical memory --------------------

def test_a_pool_larger_than_physical_memory_is_refused():
    mem = physical_memory()
    small_tx = {"tx_slots": 1, "tx_slot_size": 64}
    size = (mem - 64) // 2            # two slots: the largest receive pool that fits beside
    Settings(framing="u16", rx_slots=2, rx_slot_size=size, **small_tx)
    with pytest.raises(ValueError) as e:
        Settings(framing="u16", rx_slots=2, rx_slot_size=size + 1, **small_tx)
    msg = str(e.value)
    assert "physical memory" in msg and str(mem) in msg and "rx_slots" in msg


def test_the_send_pool_alone_is_checked():
    mem = physical_memory()
    with pytest.raises(ValueError, match=r"tx_slots \* tx_slot_size \(tx_slots=1, "
                                         rf"tx_slot_size={mem + 1}\)"):
        Settings(tx_slots=1, tx_slot_size=mem + 1)


def test_the_pools_together_are_checked():
    mem = physical_memory()
    rx = mem // 2 + 1                 # each fits alone, not both
    kw = dict(framing="u16", rx_slots=2, rx_slot_size=rx // 2 + 1,
              tx_slots=1, tx_slot_size=mem - rx)
    with pytest.raises(ValueError, match=r"rx_slots \* rx_slot_size \+ tx_slots \* "
                                         r"tx_slot_size = \d+ bytes, more than"):
        Settings(**kw)
    Settings(**{**kw, "tx_slot_size": mem - 2 * (rx // 2 + 1)})


def test_the_raw_read_pool_counts_only_with_raw_framing():
    mem = physical_memory()
    slots = mem // 2 ** 30 + 1        # 1 GiB slots: more of them than memory holds
    kw = dict(rx_read_size=2 ** 30, rx_read_slots=slots)
    with pytest.raises(ValueError, match=r"rx_read_slots \* rx_read_size"):
        Settings(framing="raw", **kw)
    Settings(framing="u16", **kw)     # (no raw read pool: nothing allocated for it)


def test_the_worker_queue_counts_only_with_workers():
    mem = physical_memory()
    k = 1 << max(0, (mem // 16).bit_length())      # cells of 16 bytes: more than fit
    if k > 2 ** 32:
        pytest.skip("this machine holds the largest worker queue")
    with pytest.raises(ValueError, match="the worker queue"):
        Settings(workers=1, worker_queue=k)
    Settings(workers=0, worker_queue=k)
    # rounded up to a power of two: k // 2 + 1 costs as much as k
    with pytest.raises(ValueError, match="the worker queue"):
        Settings(workers=1, worker_queue=k // 2 + 1)
    Settings(workers=1, worker_queue=k // 4)


# -- seconds ---------------------------------------------------------------------------------

SECONDS = ["idle_timeout", "frame_timeout", "close_linger", "shutdown_timeout",
           "proxy_header_timeout", "handshake_timeout"]
OPTIONAL = {"idle_timeout", "frame_timeout", "proxy_header_timeout"}
# the largest value each takes: what the code hands it to -- a loop timer takes any finite
# float (its wait is clamped); shutdown_timeout is a thread join's and an Event.wait's timeout
SECONDS_MAX = {name: sys.float_info.max for name in SECONDS}
SECONDS_MAX["shutdown_timeout"] = threading.TIMEOUT_MAX


@pytest.mark.parametrize("name", SECONDS)
def test_seconds_bounds(name):
    assert getattr(Settings(**{name: 1e-9}), name) == 1e-9
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            Settings(**{name: bad})
    with pytest.raises(TypeError, match=f"^{name} must be a number of seconds.*not str$"):
        Settings(**{name: "5"})
    if name in OPTIONAL:
        assert getattr(Settings(**{name: None}), name) is None
    else:
        with pytest.raises(TypeError, match=f"^{name} must be a number of seconds, not "
                                            "NoneType$"):
            Settings(**{name: None})


@pytest.mark.parametrize("name", SECONDS)
def test_seconds_upper_bound(name):
    hi = SECONDS_MAX[name]
    assert getattr(Settings(**{name: hi}), name) == hi
    above = [10 ** 400, 10 ** 5000]        # (above the largest float: inf is refused apart)
    if hi < sys.float_info.max:
        above += [math.nextafter(hi, math.inf), 2 * hi]
    for bad in above:
        # (an int too large for a float: the same named error, not a bare OverflowError)
        with pytest.raises(ValueError) as e:
            Settings(**{name: bad})
        msg = str(e.value)
        assert msg.startswith(f"{name} must be a number of seconds > 0 and <= {hi!r}"), msg
        shown = str(bad) if bad != 10 ** 5000 else "an int of 16610 bits"
        assert msg.endswith(f", not {shown}"), msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["selectors", "epoll"])
def test_a_server_at_the_seconds_bounds_serves_and_shuts_down(backend):
    # every timer armed as far ahead as a setting allows, and shutdown_timeout as long as a
    # join takes: the workers' join and shutdown()'s wait must not raise OverflowError
    kw = {name: SECONDS_MAX[name] for name in SECONDS}
    srv = Server(Echo(), HOST, backend=backend, workers=1, **kw).start()
    done = []
    try:
        with socket.create_connection(srv.address, timeout=10) as c:
            c.sendall(b"hi")
            assert c.recv(10) == b"hi"
            t = threading.Thread(target=lambda: (srv.shutdown(timeout=30), done.append(1)),
                                 daemon=True)
            t.start()
            t.join(40)
    finally:
        if not done:
            srv.shutdown(timeout=1)
    assert done == [1], "shutdown() did not return"
    assert srv.stats()["rx_slots_in_use"] == 0


# -- the bounds hold for real: a server just inside the C-type bounds serves ------------------

def test_a_server_at_the_c_type_bounds_serves(make_server):
    srv = make_server(Echo(), framing="u32", flush_budget=2 ** 62, backlog=2 ** 31 - 1,
                      rx_frame_cache=SSIZE_MAX, max_frame=2 ** 100, max_pending=2 ** 100,
                      rx_reads=1024, proxy_max_header=16 + 65535, workers=1,
                      worker_backlog=2 ** 100, accept_batch=2 ** 100)
    with socket.create_connection(srv.address, timeout=10) as c:
        big = b"x" * 100000            # a frame above the slot size: a frame buffer
        c.sendall(frame(big, "u32") + frame(b"hi", "u32"))
        assert read_frame(c, "u32") == big
        assert read_frame(c, "u32") == b"hi"


def test_a_refused_setting_opens_nothing():
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="flush_budget"):
        Server(Echo(), HOST, flush_budget=2 ** 62 + 1)
    assert len(os.listdir("/proc/self/fd")) == before
