"""The settings tables of docs/server.md and SECURITY.md, and ``serve --help``, are part of the
contract: each setting they name exists, with the default ``Settings`` really has, and no
setting is missing from docs/server.md -- so the docs cannot drift from the code again
(SECURITY.md once had no ``handshake_timeout`` row and said the server had no TLS).

A table row names its settings in backticks in its first cell (``a`` / ``b`` or ``a`` x
``b`` for a pair) and gives their defaults in the second, in the same order: a number with
an optional unit (bytes, KiB, MiB, GiB, s, frames), ``none``, ``False``/``True``, a word (a
str default), or a comma-separated list of networks.  ``*CLI* `--flag``` in the first cell
names the command-line option, whose ``--help`` must exist and show the same default.
"""
import dataclasses
import ipaddress
import pathlib
import re
import subprocess
import sys
import threading

import pytest

from aoprim.server.config import Settings

from proc_support import NEUTRAL_CWD, child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIELDS = {f.name for f in dataclasses.fields(Settings)}
DEFAULTS = Settings()
UNITS = {"": 1, "bytes": 1, "frames": 1, "s": 1, "KiB": 1 << 10, "MiB": 1 << 20,
         "GiB": 1 << 30}
# settings that choose a behaviour rather than bound a resource or a time: SECURITY.md's
# table of limits need not list them (docs/server.md must list every setting)
NOT_LIMITS = {"framing", "workers", "backend", "reuse_port", "flush_budget", "rx_reads",
              "proxy_protocol", "trusted_proxies", "ssl"}


def table_rows(path):
    """[(line number, [cells])] of every markdown table row of ``path`` that names a setting
    in its first cell (header and separator rows aside)."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if any(n in FIELDS for n in re.findall(r"`([a-z_]+)`", cells[0])):
            rows.append((i, cells))
    return rows


def names_of(cell):
    """The settings a first cell names, in order (a backticked CLI flag is not one)."""
    return [n for n in re.findall(r"`([^`]+)`", cell) if n in FIELDS]


def parse_default(text):
    """One default as written: '16 KiB' -> 16384, '30 s' -> 30.0 or 30, 'none' -> None."""
    t = text.strip().strip("`")
    if t in ("none", "None"):
        return None
    if t in ("False", "True"):
        return t == "True"
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", t)
    if m and m.group(2) in UNITS:
        num = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
        return num * UNITS[m.group(2)]
    if "/" in t and "," in t or re.fullmatch(r"[\d.:a-f]+/\d+", t):
        return tuple(ipaddress.ip_network(n.strip()) for n in t.split(","))
    if re.fullmatch(r"[a-z0-9_]+", t):
        return t
    raise AssertionError(f"cannot read the default {text!r}")


def defaults_of(cells):
    """The defaults a row gives, one per setting its first cell names."""
    names = names_of(cells[0])
    text = re.sub(r"\([^)]*\)", "", cells[1])      # (16 MiB): a remark, not a default
    if len(names) == 1:
        parts = [text]
    else:
        parts = re.split(r"\s+(?:/|x|×)\s+", text.strip())
    assert len(parts) == len(names), f"{names}: {len(names)} settings, defaults {cells[1]!r}"
    return dict(zip(names, map(parse_default, parts)))


def check_table(path):
    rows = table_rows(path)
    assert rows, f"{path.name}: no settings table found"
    seen = {}
    for line, cells in rows:
        for name, value in defaults_of(cells).items():
            assert name not in seen, f"{path.name}:{line}: {name} already in line {seen[name]}"
            seen[name] = line
            want = getattr(DEFAULTS, name)
            if name == "ssl":
                assert value is None and want is None
                continue
            assert value == want and type(value) in (type(want), int, float), \
                f"{path.name}:{line}: {name} documented as {cells[1]!r}, Settings has {want!r}"
    return seen, rows


@pytest.fixture(scope="module")
def serve_help():
    """``serve --help`` -> {flag: its help text on one line}."""
    r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--help"],
                       capture_output=True, text=True, timeout=60, cwd=NEUTRAL_CWD,
                       env=child_env(COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    opts = r.stdout.split("options:", 1)[1]
    entries = ["--" + e for e in opts.split("\n  --")[1:]]
    return {e.split()[0]: " ".join(e.split()) for e in entries}


def cli_default(text):
    m = re.findall(r"\(default: ([^)]*)\)", text)
    assert m, text
    return m[-1]


def test_docs_server_md_lists_every_setting_with_its_default():
    seen, _ = check_table(ROOT / "docs" / "server.md")
    missing = FIELDS - set(seen)
    assert not missing, f"settings missing from docs/server.md's tables: {sorted(missing)}"


def test_security_md_lists_every_limit_with_its_default(serve_help):
    seen, rows = check_table(ROOT / "SECURITY.md")
    missing = FIELDS - NOT_LIMITS - set(seen)
    assert not missing, f"limits missing from SECURITY.md's table: {sorted(missing)}"
    # a row marked *CLI* names the option, which exists
    for line, cells in rows:
        if "*CLI*" in cells[0]:
            flags = re.findall(r"`(--[a-z-]+)`", cells[0])
            assert flags, f"SECURITY.md:{line}: *CLI* without the option's name"
            for f in flags:
                assert f in serve_help, f"SECURITY.md:{line}: {f} is not an option of serve"


def test_no_setting_is_both_a_limit_and_not_one():
    assert NOT_LIMITS <= FIELDS, sorted(NOT_LIMITS - FIELDS)


def test_the_cli_help_shows_each_settings_default(serve_help):
    """Each option that sets a setting (--max-frame for max_frame; --trusted-proxy for
    trusted_proxies) shows the default Settings has."""
    checked = 0
    for flag, text in serve_help.items():
        name = flag[2:].replace("-", "_")
        if name == "trusted_proxy":
            name = "trusted_proxies"
        if name not in FIELDS:
            continue
        want = getattr(DEFAULTS, name)
        shown = cli_default(text)
        if want is None:
            assert shown in ("None", "none", "off"), f"{flag}: default {shown!r}, want none"
        elif name == "trusted_proxies":
            assert parse_default(shown) == want, f"{flag}: {shown!r}"
        elif isinstance(want, (int, float)):
            assert float(shown) == want, f"{flag}: default {shown!r}, Settings has {want!r}"
        else:
            assert shown == str(want), f"{flag}: default {shown!r}, Settings has {want!r}"
        checked += 1
    assert checked >= 10, serve_help.keys()


def test_a_range_in_the_cli_help_is_the_one_settings_enforce(serve_help):
    for flag, text in serve_help.items():
        name = flag[2:].replace("-", "_")
        m = re.search(r"\b(\d+)\.\.(\d+)\b", text)
        if name not in FIELDS or not m:
            continue
        lo, hi = int(m.group(1)), int(m.group(2))
        Settings(**{name: lo})
        Settings(**{name: hi})
        for bad in (lo - 1, hi + 1):
            with pytest.raises(ValueError, match=name):
                Settings(**{name: bad})


def test_security_md_describes_the_tls_the_server_has():
    text = (ROOT / "SECURITY.md").read_text()
    assert "No TLS" not in text
    assert "`ssl=`" in text and "handshake_timeout" in text


def test_idle_timeout_means_the_same_in_both_docs():
    """Idle is neither direction moving: a peer slowly taking a long reply is not idle."""
    for path in (ROOT / "SECURITY.md", ROOT / "docs" / "server.md"):
        row = next(c for _, c in table_rows(path) if names_of(c[0]) == ["idle_timeout"])
        meaning = " ".join(row[2:])
        assert "taken" in meaning or "takes" in meaning, f"{path.name}: {meaning}"


def test_the_parser_reads_what_the_tables_hold():
    # (the reader itself can fail: a wrong default, an unknown unit, a pair miscounted)
    assert defaults_of(["`rx_slot_size` × `rx_slots`", "16 KiB × 1024"]) == \
        {"rx_slot_size": 16384, "rx_slots": 1024}
    assert defaults_of(["`high_water` / `low_water`", "256 KiB / 64 KiB"]) == \
        {"high_water": 262144, "low_water": 65536}
    assert defaults_of(["`frame_timeout` (*CLI* `--frame-timeout`)", "30 s"]) == \
        {"frame_timeout": 30}
    assert defaults_of(["`trusted_proxies`", "127.0.0.0/8, ::1/128"]) == \
        {"trusted_proxies": DEFAULTS.trusted_proxies}
    with pytest.raises(AssertionError):
        defaults_of(["`rx_slot_size` × `rx_slots`", "16 KiB"])
    with pytest.raises(AssertionError):
        parse_default("16 furlongs")


def test_the_seconds_ranges_in_server_md_are_the_ones_settings_enforce():
    """Each seconds setting's row states its range; Settings takes its top and refuses
    above it (an int too large for a float included) with an error naming the setting."""
    tops = {"the largest finite float": sys.float_info.max,
            "`threading.TIMEOUT_MAX`": threading.TIMEOUT_MAX}
    checked = 0
    for line, cells in table_rows(ROOT / "docs" / "server.md"):
        m = re.search(r"range 0 < s ≤ (the largest finite float|`threading\.TIMEOUT_MAX`)",
                      cells[-1])
        if m is None:
            continue
        (name,) = names_of(cells[0])
        hi = tops[m.group(1)]
        assert getattr(Settings(**{name: hi}), name) == hi
        for bad in [10 ** 400] + ([2 * hi] if hi < sys.float_info.max else []):
            with pytest.raises(ValueError,
                               match=f"^{name} must be .* <= {re.escape(repr(hi))}"):
                Settings(**{name: bad})
        checked += 1
    seconds = {f.name for f in dataclasses.fields(Settings) if f.type.startswith("float")}
    assert checked == len(seconds) == 6, seconds
