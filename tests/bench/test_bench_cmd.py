"""``python -m aoprim bench``, run as a user runs it (a subprocess of the installed package).

One tiny run (``--tiny``: a test-only size, every group and every server, a few seconds) is
shared by the tests that read its output; --compare, --plot and --load re-read its JSON and
measure nothing.  Budget: the whole file stays within ~30 s of wall time.
"""
import copy
import json
import os
import subprocess
import sys

import pytest

from aoprim.benchmarks import cases, contention, report, schema, suite

from proc_support import NEUTRAL_CWD, child_env


def bench(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "aoprim", "bench", *args],
                          capture_output=True, text=True, cwd=NEUTRAL_CWD,
                          env=env or child_env(), timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(completed process, parsed JSON, JSON path) of one --tiny run of everything."""
    d = tmp_path_factory.mktemp("bench")
    path = str(d / "run.json")
    r = bench("--tiny", "--json", path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(path) as f:
        return r, json.load(f), path


def test_runs_end_to_end_with_header_tables_and_progress(tiny):
    r, doc, _ = tiny
    out = r.stdout
    for label in ("machine:", "python:", "aoprim:", "compiler:", "servers:", "syscalls:"):
        assert f"\n{label}" in out, label
    assert "measured warm" in out                  # the header says servers were warmed
    for g in doc["groups"]:
        assert f"[{g['id']}]" in out                # one table per group
    assert "(baseline)" in out and "x1.00" in out
    assert "syscalls/msg" in out and "faults/msg" in out     # the server tables' columns
    assert "\n* " in out                            # a winner is marked
    # the progress bar went to stderr, and reached the end
    assert "[" in r.stderr and "100%" in r.stderr and "done" in r.stderr
    # the tables printed as the groups ended are the text --load prints for the saved run,
    # and no line is wider than 100 columns
    assert out.startswith(report.render(doc) + "\n"), out[:2000]
    assert max(len(line) for line in (out + r.stderr).splitlines()) <= 100


def test_json_follows_the_documented_schema(tiny):
    _, doc, _ = tiny
    assert schema.validate(doc) == []
    assert doc["schema"] == schema.SCHEMA_ID
    ids = {g["id"] for g in doc["groups"]}
    # every default group ran: each primitive beside its baseline, C level, contention
    assert ids >= {g.id for g in cases.GROUPS if g.default}
    assert ids >= {g.id for g in contention.groups()}
    for g in doc["groups"]:
        assert g["entries"], g["id"]
        base = [e for e in g["entries"] if e["role"] == "baseline"]
        assert len(base) == 1 and base[0]["ratio"] == pytest.approx(1.0), g["id"]
        assert sum(e["winner"] for e in g["entries"]) <= 1
        for e in g["entries"]:
            assert e["min"] <= e["median"] <= e["max"]
    threads = sorted(g["params"]["threads"] for g in doc["groups"]
                     if "contention-lock" in g["series"])
    assert threads == [1, 2, 4, 8]
    srv = next(g for g in doc["groups"] if g["kind"] == "server")
    names = {e["name"] for e in srv["entries"]}
    assert {"aoprim", "asyncio"} <= names
    for e in srv["entries"]:
        assert {"msgs_per_s", "p50_us", "p99_us", "faults_per_msg"} <= set(e["metrics"])
        assert e["metrics"]["msgs_per_s"]["median"] > 0
        assert e["metrics"]["faults_per_msg"]["median"] >= 0
    # what could not run is listed with a reason (another backend, aoprim.aio, ...)
    assert all(s["reason"] for s in doc["skipped"])


def test_the_validator_catches_a_broken_document(tiny):
    _, doc, _ = tiny
    bad = copy.deepcopy(doc)
    del bad["groups"][0]["entries"][0]["median"]
    bad["header"]["cores"] = "two"
    problems = schema.validate(bad)
    assert any("median" in p for p in problems) and any("cores" in p for p in problems)


def test_compare_prints_the_change_between_two_files(tiny, tmp_path):
    _, doc, path = tiny
    old = copy.deepcopy(doc)
    g = old["groups"][0]
    for e in g["entries"]:                     # the old run was twice as slow
        for k in ("median", "min", "max", "q1", "q3"):
            e[k] *= 2
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(old))
    r = bench("--load", path, "--compare", str(old_path))
    assert r.returncode == 0, r.stderr
    assert "compared with" in r.stdout
    section = r.stdout.split(f"[{g['id']}] (", 1)[1].split("\n[", 1)[0]
    assert "better" in section and "-50.0%" in section


def test_compare_refuses_a_file_that_is_not_a_run(tiny, tmp_path):
    _, _, path = tiny
    p = tmp_path / "x.json"
    p.write_text('{"hello": 1}')
    r = bench("--load", path, "--compare", str(p))
    assert r.returncode == 2 and "not an aoprim bench document" in r.stderr


def test_plot_writes_png_charts(tiny, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the plot extra)")
    _, _, path = tiny
    r = bench("--load", path, "--plot", str(tmp_path / "plots"))
    assert r.returncode == 0, r.stderr
    made = sorted(os.listdir(tmp_path / "plots"))
    assert made == ["contention.png", "ratios.png", "servers.png"]
    for name in made:
        with open(tmp_path / "plots" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tiny, tmp_path):
    _, _, path = tiny
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "matplotlib.py").write_text("raise ImportError('hidden by the test')\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hide), env["PYTHONPATH"]])
    r = bench("--load", path, "--plot", str(tmp_path / "plots"), env=env)
    assert r.returncode == 2
    assert "pip install 'aoprim[plot]'" in r.stderr
    assert not (tmp_path / "plots").exists()


def test_only_selects_groups(tmp_path):
    path = tmp_path / "only.json"
    r = bench("--tiny", "--no-progress", "--only", "atomic", "lock-with", "--json", str(path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(path.read_text())
    assert schema.validate(doc) == []
    ids = {g["id"] for g in doc["groups"]}
    want = {g.id for g in cases.GROUPS if g.family == "atomic"} | {"lock-with"}
    assert ids == want
    assert doc["header"]["selected"] == ["atomic", "lock-with"]
    assert r.stderr == ""                           # --no-progress


def test_only_refuses_an_unknown_name():
    r = bench("--only", "nosuchgroup")
    assert r.returncode == 2 and "matches no group" in r.stderr


def test_plan_selection_rules():
    ids = [g.id for g in suite.plan("full", ["c"])]
    assert ids and all(i.startswith("c-") for i in ids)
    assert "sendbatch-cutoff-00256B" not in [g.id for g in suite.plan("full")]
    assert "sendbatch-cutoff-00256B" in [g.id for g in suite.plan("full", ["sendbatch-cutoff"])]
    servers = [g.id for g in suite.plan("full", ["server"])]
    assert "server-raw-1k-1000" in servers and "server-raw-64k-10" in servers
    # the size curve runs up to 1 MiB: 64 B ... 64 KiB, 256 KiB, 1 MiB
    sizes = sorted(g.params["size"] for g in suite.plan("full", ["server"])
                   if "server-sizes" in g.series)
    assert sizes == [64, 1024, 16384, 65536, 262144, 1 << 20]


def test_large_message_scenarios_run_more_shorter_rounds_in_the_full_mode():
    """The 64 KiB - 1 MiB points (kernel-copy bound, pinned to one CPU): the full
    run gives them 5 rounds of 1.5 s; every other scenario keeps the mode's 3 of 2 s."""
    g = suite.ServerGroup("raw-256k-10")
    calls = []

    def run_one(name, scenario, duration, warmup, syscalls):
        calls.append((name, scenario, duration, syscalls))
        return {"server_cpu": {"cpu_us_per_msg": 10.0 + len(calls), "user_us_per_msg": 1.0,
                               "sys_us_per_msg": 9.0},
                "msgs_per_s": 1000.0, "p50_us": 1, "p99_us": 2}

    g.run_one = run_one
    res = suite._server_group(g, ["asyncio", "aoprim"], suite.MODES["full"], None, {}, True)
    assert len(calls) == 10 and {c[2] for c in calls} == {1.5}
    assert [c[3] for c in calls].count(True) == 2          # syscalls: first round only
    assert [e["rounds"] for e in res["entries"]] == [5, 5]
    small = suite.ServerGroup("raw-1k-10")
    calls.clear()
    small.run_one = run_one
    suite._server_group(small, ["asyncio"], suite.MODES["full"], None, {}, True)
    assert [c[2] for c in calls] == [2.0, 2.0, 2.0]
    assert suite._server_settings(suite.MODES["quick"], "raw-64k-10")["rounds"] == 1
    assert suite.steps([g, small], "full", 2) == 5 * 2 + 3 * 2


def test_per_scenario_settings_name_known_scenarios():
    """A per-scenario override keyed by a misspelt scenario would silently never apply."""
    from aoprim.benchmarks import servers, tls
    known = set(servers.SCENARIOS) | set(tls.SCENARIOS)
    for mode, m in suite.MODES.items():
        extra = set(m["server"].get("per_scenario", {})) - known
        assert not extra, (mode, extra)
    full = suite.MODES["full"]
    assert suite._server_settings(full, "tls-raw-1k-10")["rounds"] == 7
    assert suite._server_settings(full, "tls-u16-64x16-10")["rounds"] == 3
    assert suite._server_settings(suite.MODES["quick"], "tls-raw-1k-10")["rounds"] == 1


def test_u32_large_frame_point_runs_on_asyncio_and_aoprim():
    # u32 frames of 1 MiB, aoprim served with --max-frame 1 MiB
    from aoprim.benchmarks import servers
    assert "u32-1m-10" in [g.scenario for g in suite.plan("full", ["server"])]
    cmd = servers.server_cmd("aoprim-epoll", "u32", 1 << 20)
    assert cmd[cmd.index("--max-frame") + 1] == str(1 << 20)
    assert "--max-frame" not in servers.server_cmd("asyncio", "u32", 1 << 20)
    for name in ("asyncio", "aoprim"):
        res = servers.run_one(name, "u32-1m-10", duration=0.4, warmup=0.1)
        assert res["errors"] == [] and res["msgs"] > 0, (name, res["errors"])
        assert res["faults_per_msg"] >= 0


def test_large_message_scenarios_put_server_and_load_generator_on_one_cpu(monkeypatch):
    """one_cpu scenarios: both processes pinned to the same CPU before the measured window
    (the kernel copy's cost must not depend on where the host placed the vCPUs); the
    others are left free."""
    import os
    from aoprim.benchmarks import servers
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to pin")
    seen = []
    real = servers._pin

    def pin(pid, cpu):
        real(pid, cpu)
        seen.append((cpu, os.sched_getaffinity(pid)))

    monkeypatch.setattr(servers, "_pin", pin)
    res = servers.run_one("asyncio", "raw-64k-10", duration=0.3, warmup=0.1)
    cpu = max(os.sched_getaffinity(0))
    assert res["errors"] == [] and res["one_cpu"] == cpu
    assert seen == [(cpu, {cpu}), (cpu, {cpu})]        # the server, then the generator
    assert "one CPU" in suite.ServerGroup("raw-1m-10").title
    seen.clear()
    res = servers.run_one("asyncio", "raw-1k-10", duration=0.3, warmup=0.1)
    assert "one_cpu" not in res and all(c is None for c, _ in seen)
    assert "one CPU" not in suite.ServerGroup("raw-1k-10").title


def test_loadgen_counts_the_server_page_faults_and_builds_large_messages_fast():
    import time

    from aoprim.tools import loadgen
    # the same bytes as ever (byte i of variant k), built without a per-byte Python loop
    for k, size in ((0, 300), (5, 70001), (63, 65536 * 2 + 17)):
        want = bytes(((k * 131 + i * 7) ^ (i >> 8)) & 0xFF for i in range(size))
        assert loadgen._payload(k, size) == want
    t = time.monotonic()
    msgs = loadgen._messages(1 << 20, "raw")
    assert len(msgs) == 64 and all(len(m) == 1 << 20 for m in msgs)
    assert time.monotonic() - t < 20             # was ~30 s of Python per-byte loops
    # field 10 of /proc/PID/stat: touching 64 fresh pages faults at least 64 times
    f0 = loadgen.proc_cpu(os.getpid())[2]
    import mmap
    m = mmap.mmap(-1, 64 * 4096)
    for i in range(0, 64 * 4096, 4096):
        m[i] = 1
    m.close()
    assert loadgen.proc_cpu(os.getpid())[2] - f0 >= 64


def test_new_loops_and_backends_join_the_server_groups_when_they_exist(monkeypatch):
    import types

    import aoprim.server.loop
    from aoprim.benchmarks import servers
    run, skipped = servers.available_servers()
    assert run[0] == "aoprim" and "asyncio" in run
    assert all(reason for _, reason in skipped)
    fake = types.ModuleType("aoprim.aio")
    fake.new_event_loop = lambda: None
    monkeypatch.setitem(sys.modules, "aoprim.aio", fake)
    monkeypatch.setattr(aoprim, "aio", fake, raising=False)
    monkeypatch.setattr(aoprim.server.loop, "BACKENDS", ("selectors", "uring"))
    run, skipped = servers.available_servers()
    assert "aoprim.aio" in run and "aoprim-uring" in run
    assert servers.server_cmd("aoprim-uring", "raw")[-2:] == ["--backend", "uring"]
    assert "--backend" not in servers.server_cmd("aoprim-base", "raw")
    assert servers.server_cmd("aoprim.aio", "u16")[-2:] == ["--loop", "aio"]


def test_a_tree_swaps_aoprim_aio_and_the_backends_not_the_asyncio_servers(monkeypatch):
    # large_compare --baseline-tree sets TREES["aoprim"]: aoprim.aio must come from that
    # checkout too (it did not: its @base row measured this checkout's aoprim.aio)
    from aoprim.benchmarks import servers
    monkeypatch.setitem(servers.TREES, "aoprim", "/some/checkout")
    monkeypatch.setitem(servers.TREES, "aoprim-base", "/other")
    for name in ("aoprim.aio", "aoprim", "aoprim-epoll", "aoprim-selectors"):
        assert servers._tree_of(name) == "/some/checkout", name
    assert servers._tree_of("aoprim-base") == "/other"
    assert servers._tree_of("asyncio") is None and servers._tree_of("uvloop") is None
    assert servers._env(servers._tree_of("aoprim.aio"))["PYTHONPATH"].split(os.pathsep)[0] \
        == "/some/checkout"


_TOY_SERVER = """
import signal, socket, sys, time
# (what it inherited, for a failure's message: an ignored or blocked SIGINT survives exec)
sys.stderr.write(f"SIGINT {signal.getsignal(signal.SIGINT)!r}, blocked "
                 f"{sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}\\n")
sys.stderr.flush()
if sys.argv[1] == "refuse":
    print("no port for you", flush=True)
    sys.stderr.write("toy: bind failed\\n")
    sys.exit(3)
if sys.argv[1] == "deaf":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
s = socket.socket()
s.bind(("127.0.0.1", 0))
try:
    print(f"listening on 127.0.0.1:{s.getsockname()[1]}", flush=True)
    time.sleep(120)
except KeyboardInterrupt:
    print("stats {}", flush=True)
"""


def test_compared_servers_start_and_stop_in_one_place(tmp_path):
    """servers.start_server reads the port from the first line; stop_server ends the server
    with SIGINT and hands back what it printed (a second call is a no-op), kills one that
    ignores SIGINT, and a server that does not start is gone when the error names it."""
    import signal

    from aoprim.benchmarks import servers
    script = tmp_path / "toy_server.py"
    script.write_text(_TOY_SERVER)
    p, port = servers.start_server([sys.executable, str(script), "polite"], "toy")
    assert 0 < port < 65536 and p.poll() is None
    out, err = servers.stop_server(p)
    assert p.returncode == 0 and out == "stats {}\n", err
    assert servers.stop_server(p) == ("", "") and p.stdout.closed and p.stderr.closed
    p, port = servers.start_server([sys.executable, str(script), "deaf"], "deaf toy")
    servers.stop_server(p, timeout=0.5)
    assert p.returncode == -signal.SIGKILL
    with pytest.raises(RuntimeError, match=r"refusing toy did not start: 'no port for you' "
                                           r".*toy: bind failed") as e:
        servers.start_server([sys.executable, str(script), "refuse"], "refusing toy",
                             error=RuntimeError)
    assert not isinstance(e.value, servers.ServerUnavailable)


def test_a_server_that_cannot_start_is_reported_not_fatal():
    from aoprim.benchmarks import servers
    with pytest.raises(servers.ServerUnavailable, match="did not start"):
        servers.run_one("aoprim-nosuchbackend", "raw-1k-10", duration=0.2)


# ---- the tls groups ------------------------------------------------------------------------

def test_tls_groups_are_listed_and_selected_by_family():
    r = bench("--list")
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    for gid in ("tls-u16-64x16-10", "tls-raw-1k-10", "tls-handshake"):
        assert gid in listed and " tls " in listed[gid], r.stdout
        assert "(only when named)" not in listed[gid]          # a default group
    assert [g.id for g in suite.plan("full", ["tls"])] == ["tls-u16-64x16-10", "tls-raw-1k-10",
                                                           "tls-handshake"]
    # the test suite's --tiny run of everything leaves them out (they run when named)
    assert not any(g.family == "tls" for g in suite.plan("tiny"))


def test_tls_groups_run_a_tiny_round(tmp_path):
    path = tmp_path / "tls.json"
    r = bench("--tiny", "--no-progress", "--only", "tls", "--json", str(path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert schema.validate(doc) == []
    groups = {g["id"]: g for g in doc["groups"]}
    assert set(groups) == {"tls-u16-64x16-10", "tls-raw-1k-10", "tls-handshake"}
    assert "records/msg" in r.stdout and "wire B/msg" in r.stdout
    for gid, g in groups.items():
        assert g["kind"] == "server" and g["family"] == "tls"
        assert g["baseline"] == "asyncio"
        names = {e["name"] for e in g["entries"]}
        assert "asyncio" in names, (gid, g["skipped"])
        # the bench ships with the server it measures: aoprim's server always speaks TLS
        assert "aoprim" in names, (gid, g["skipped"])
        for e in g["entries"]:
            m = e["metrics"]
            assert m["msgs_per_s"]["median"] > 0, (gid, e["name"])
            assert {"records_per_msg", "wire_bytes_per_msg"} <= set(m), (gid, e["name"])
    u16 = {e["name"]: e["metrics"] for e in groups["tls-u16-64x16-10"]["entries"]}
    # asyncio writes each 66-byte frame as its own record: one record, 66 + 22 bytes each
    assert 0.9 <= u16["asyncio"]["records_per_msg"]["median"] <= 1.1
    assert 85 <= u16["asyncio"]["wire_bytes_per_msg"]["median"] <= 95
    if "aoprim" in u16:         # one record per flush: 16 frames read together leave together
        assert u16["aoprim"]["records_per_msg"]["median"] <= 0.5, u16["aoprim"]
    hs = {e["name"]: e["metrics"] for e in groups["tls-handshake"]["entries"]}
    assert hs["asyncio"]["records_per_msg"]["median"] >= 3       # a whole handshake each


def test_a_missing_aoprim_aio_is_skipped_alike_by_the_server_and_aio_groups(monkeypatch):
    """servers.available_servers() and aio.available_loops() share one aoprim.aio check."""
    from aoprim.benchmarks import aio, servers
    monkeypatch.setitem(sys.modules, "aoprim.aio", None)    # import aoprim.aio -> ImportError
    _, s_skipped = servers.available_servers()
    _, a_skipped = aio.available_loops()
    (why,) = [r for n, r in s_skipped if n == "aoprim.aio"]
    assert why.startswith("aoprim.aio is not available (")
    assert ("aoprim.aio", why) in a_skipped
