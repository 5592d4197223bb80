from __future__ import annotations

import pytest

from kvd.config import Config, load, parse_size
from kvd.errors import ConfigError


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    f = tmp_path / "kvd.toml"
    f.write_text('pool_size = "1G"\npolicy = "lru"\ncopy_threads = 3\nlog_level = "debug"\n')
    env = {"KVD_POOL_SIZE": "2G", "KVD_COPY_THREADS": "4"}
    cfg, origin = load(str(f), env, {"pool_size": "3G"})
    assert cfg.pool_size == 3 << 30 and origin["pool_size"] == "flag"
    assert cfg.copy_threads == 4 and origin["copy_threads"] == "env"
    assert cfg.log_level == "debug" and origin["log_level"].startswith("file")
    assert cfg.extent_size == Config().extent_size and origin["extent_size"] == "default"


def test_unknown_key_is_rejected_naming_it(tmp_path):
    f = tmp_path / "kvd.toml"
    f.write_text("pool_sise = 5\n")
    with pytest.raises(ConfigError, match="pool_sise"):
        load(str(f), {})
    with pytest.raises(ConfigError, match="bogus"):
        load(None, {"KVD_BOGUS": "1"})


@pytest.mark.parametrize("env,key", [
    ({"KVD_COPY_THREADS": "many"}, "copy_threads"),
    ({"KVD_LOG_LEVEL": "loud"}, "log_level"),
    ({"KVD_POOL_SIZE": "12Q"}, "KVD_POOL_SIZE|pool_size"),
])
def test_bad_values_are_rejected_naming_the_key(env, key):
    with pytest.raises(ConfigError, match=key):
        load(None, env)


@pytest.mark.parametrize("env,match", [
    # Each was a traceback at start (some only after the whole pool was faulted in), a
    # world-writable socket, or a daemon that dropped every message.
    ({"KVD_EXTENT_SIZE": "0"}, "extent_size .* min_slot_bytes"),
    ({"KVD_MIN_SLOT_BYTES": "128M"}, "extent_size .* min_slot_bytes"),
    ({"KVD_POLICY": "bogus"}, "policy 'bogus': known policies are .*adaptive"),
    ({"KVD_DISK_POLICY": "bogus"}, "disk_policy 'bogus'"),
    ({"KVD_POOL_SIZE": "99999999999999999T"}, "pool_size .* more than 1 EiB"),
    ({"KVD_SOCKET_MODE": "99"}, "socket_mode: not an octal mode"),
    ({"KVD_MAX_MESSAGE_BYTES": "0"}, "max_message_bytes 0 not in 4096.."),
    # These two passed the load and then failed in ZeroMQ's setsockopt, a traceback.
    ({"KVD_MAX_MESSAGE_BYTES": str(1 << 62)}, "max_message_bytes .* not in 4096.."),
    ({"KVD_EVENTS_HWM": str(1 << 31)}, "events_hwm .* not in 1..2147483647"),
    ({"KVD_METRICS_ADDR": "not an addr"}, "metrics_addr 'not an addr'"),
    ({"KVD_ALLOWED_UIDS": "1000,-1"}, "allowed_uids: -1 is not a uid"),  # matched nobody
    ({"KVD_ADMIN_UIDS": str(1 << 40)}, "admin_uids: .* is not a uid"),
    ({"KVD_EVENTS_TOPIC": "{tenant[0]}"}, "events_topic .* use only"),
    # A format width took a GiB per topic (validation too); a time past clocks' range was
    # a traceback in a tier thread; a port past 65535 wrapped to another port; an
    # abstract or over-long socket was a traceback, or refused after the pool was made.
    ({"KVD_EVENTS_TOPIC": "kv@{tenant:>999999999}"}, "events_topic .* without formats"),
    ({"KVD_EVENTS_TOPIC": "kv@{model!r}"}, "events_topic .* without formats"),
    ({"KVD_REMOTE_TIMEOUT_MS": str(1 << 63)}, "remote_timeout_ms .* more than 30 days"),
    ({"KVD_MAX_LEASE_MS": str(31 * 86_400_000)}, "max_lease_ms .* more than 30 days"),
    ({"KVD_REMOTE_TTL_S": str(1 << 60)}, "remote_ttl_s .* not in 0 \\(no TTL\\)"),
    ({"KVD_EVENTS_ENDPOINT": "tcp://127.0.0.1:99999"}, "events_endpoint .* not 0..65535"),
    ({"KVD_EVENTS_ENDPOINT": "tcp://*:5557", "KVD_EVENTS_REPLAY_ENDPOINT": "tcp://*:"},
     "events_replay_endpoint .* not 0..65535"),
    ({"KVD_EVENTS_ENDPOINT": "ipc://"}, "events_endpoint .* expected ipc://NAME"),
    ({"KVD_SOCKET": "@kvd"}, "socket '@kvd': expected a file path"),
    ({"KVD_SOCKET": ""}, "socket '': expected a file path"),
    ({"KVD_SOCKET": "/tmp/" + "s" * 120}, "socket .* longer than a unix socket's path"),
])
def test_values_that_cannot_work_are_refused_at_load_naming_where_they_came_from(env, match):
    with pytest.raises(ConfigError, match=match) as e:
        load(None, env)
    if "octal" not in match:
        assert "(from env)" in str(e.value)


def test_socket_mode_is_octal_from_every_source_and_within_0o777(tmp_path):
    for value in ("0660", "0o660", "660"):
        assert load(None, {"KVD_SOCKET_MODE": value})[0].socket_mode == 0o660
    f = tmp_path / "kvd.toml"
    for text in ("socket_mode = -1\n", "socket_mode = 99999999999\n"):
        f.write_text(text)
        with pytest.raises(ConfigError, match="socket_mode .* not in 0..0o777"):
            load(str(f), {})


def test_allowed_groups_take_gids_as_numbers_too(tmp_path):
    f = tmp_path / "kvd.toml"
    f.write_text('allowed_groups = [0, "root"]\n')
    assert load(str(f), {})[0].allowed_groups == ["0", "root"]


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="extent_size"):
        load(None, {}, {"pool_size": "1M", "extent_size": "64M"})


@pytest.mark.parametrize("flags,match", [
    # A journal on the pool file: its rewrite at start renamed itself over the pool
    # (served from an unlinked inode, no warm restart ever again, and a second daemon no
    # longer kept out by the pool's lock).
    ({"pool_path": "/dev/shm/p", "journal_path": "/dev/shm/p"},
     "journal_path and pool_path are the same file"),
    ({"pool_path": "/dev/shm/p", "socket": "/dev/shm/./p"},
     "socket and pool_path are the same file"),
    ({"disk_path": "/tmp/kvd-d", "disk_size": "64M", "journal_path": "/tmp/kvd-d/kvd-disk.slots"},
     "disk_path's kvd-disk.slots and journal_path are the same file"),
])
def test_one_file_named_for_two_things_is_refused(flags, match):
    with pytest.raises(ConfigError, match=match):
        load(None, {}, flags)


def test_an_ipc_events_endpoint_on_another_file_is_refused(tmp_path):
    """Binding there replaced the file (a pool file, a journal, anyone's file) with a
    socket: the pool was gone at start, said only as 'was removed'."""
    precious = tmp_path / "notes.txt"
    precious.write_text("keep")
    with pytest.raises(ConfigError, match="is a file that is not a socket"):
        load(None, {}, {"events_endpoint": f"ipc://{precious}"})
    with pytest.raises(ConfigError, match="events_endpoint and pool_path are the same"):
        load(None, {}, {"pool_path": str(tmp_path / "p"),
                        "events_endpoint": f"ipc://{tmp_path / 'p'}"})
    with pytest.raises(ConfigError, match="are the same file"):
        load(None, {}, {"events_endpoint": f"ipc://{tmp_path / 'e'}",
                        "events_replay_endpoint": f"ipc://{tmp_path / 'e'}"})
    assert precious.read_text() == "keep"
    load(None, {}, {"events_endpoint": f"ipc://{tmp_path / 'e'}",  # a path of its own
                    "events_replay_endpoint": "tcp://127.0.0.1:*"})


def test_a_pool_holds_whole_extents():
    """The rest of a pool_size that is no multiple of extent_size was reserved in
    /dev/shm (and faulted in) but never held a block."""
    cfg = load(None, {}, {"pool_size": "127M", "extent_size": "64M"})[0]
    assert (cfg.pool_size, cfg.pool_bytes) == (127 << 20, 64 << 20)
    assert load(None, {}, {"pool_size": "128M", "extent_size": "64M"})[0].pool_bytes == 128 << 20


def test_sizes():
    assert parse_size("512M") == 512 << 20
    assert parse_size("4G") == 4 << 30
    assert parse_size("1.5K") == 1536
    assert parse_size(123) == 123
    assert parse_size("9007199254740993") == 9007199254740993  # a float rounded it
    for bad in ("big", "0.3K", "1.5"):  # fractions of a byte were cut without a word
        with pytest.raises(ValueError):
            parse_size(bad)


def test_a_services_links_are_not_taken_for_configuration():
    """A Kubernetes Service named kvd puts KVD_SERVICE_HOST, KVD_PORT... into every pod
    of its namespace; each was an unknown key, and kvd refused to start."""
    links = {"KVD_SERVICE_HOST": "10.0.0.1", "KVD_SERVICE_PORT": "9727",
             "KVD_SERVICE_PORT_METRICS": "9727", "KVD_PORT": "tcp://10.0.0.1:9727",
             "KVD_PORT_9727_TCP": "tcp://10.0.0.1:9727", "KVD_PORT_9727_TCP_ADDR": "10.0.0.1"}
    cfg, _ = load(None, {**links, "KVD_METRICS_PORT": "9727"})
    assert cfg.metrics_port == 9727
    with pytest.raises(ConfigError, match="unknown key 'ports'"):
        load(None, {"KVD_PORTS": "1"})  # not a link's name: still refused


@pytest.mark.parametrize("env,match", [
    ({"KVD_DISK_PATH": "/tmp/d", "KVD_DISK_SIZE": "1M"}, "disk_size"),
    ({"KVD_REMOTE": "redis://h:1,,"}, "remote"),
    ({"KVD_REMOTE_LOOKUP_MS": "-1"}, "remote_lookup_ms"),
    ({"KVD_REMOTE_TIMEOUT_MS": "0"}, "remote_timeout_ms"),
    ({"KVD_TIER_QUEUE_BYTES": "0"}, "tier_queue_bytes"),
    ({"KVD_PROMOTE_MAX_BLOCKS": "0"}, "promote_max_blocks"),
    ({"KVD_REMOTE_TTL_S": "-5"}, "remote_ttl_s"),
])
def test_tier_settings_are_validated(env, match):
    with pytest.raises(ConfigError, match=match):
        load(None, env)


def test_tier_settings_are_read_with_sizes():
    cfg, _ = load(None, {"KVD_DISK_PATH": "/var/lib/kvd", "KVD_DISK_SIZE": "2T",
                         "KVD_TIER_QUEUE_BYTES": "64M", "KVD_REMOTE_LOOKUP_MS": "0"})
    assert cfg.disk_size == 2 << 40 and cfg.tier_queue_bytes == 64 << 20
    assert cfg.remote_lookup_ms == 0 and cfg.remote == ""


def test_a_key_given_in_both_spellings_is_refused(tmp_path):
    """``max-lease-ms`` and ``max_lease_ms`` in one file: the last one silently won."""
    f = tmp_path / "kvd.toml"
    f.write_text("max-lease-ms = 5\nmax_lease_ms = 6\n")
    with pytest.raises(ConfigError, match="max_lease_ms is given twice"):
        load(str(f), {})
    f.write_text("max-lease-ms = 5\n")
    assert load(str(f), {})[0].max_lease_ms == 5


def test_a_config_file_that_is_no_regular_file_is_refused_at_once(tmp_path):
    """A reload reads the file on the event loop: a FIFO held every client until someone
    wrote to it (and /dev/zero would be read for ever)."""
    import os
    import time

    from kvd.config import read_toml
    from kvd.errors import ConfigError

    fifo = tmp_path / "kvd.toml"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="not a regular file"):
            read_toml(path)
        assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("line, key", [
    ('max_lease_ms = "ten"', "max_lease_ms"),  # a type
    ('policy = "lfu-typo"', "policy"),  # a check of its own
    ('min_slot_bytes = "1G"', "min_slot_bytes"),  # a check against another key
])
def test_a_bad_value_hidden_by_a_higher_source_is_warned_of(tmp_path, caplog, line, key):
    """It passed unseen, and stopped the daemon the day the environment variable or
    flag that hid it went (a unit file edited): said at every read of the sources."""
    f = tmp_path / "kvd.toml"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError, match=key):  # on its own: refused
        load(str(f), {})
    env = {"KVD_" + key.upper(): {"max_lease_ms": "100", "policy": "lru",
                                  "min_slot_bytes": "8K"}[key]}
    with caplog.at_level("WARNING", logger="kvd.config"):
        cfg, origin = load(str(f), env)
    assert origin[key] == "env"
    warned = [r.getMessage() for r in caplog.records if r.name == "kvd.config"]
    assert len(warned) == 1 and warned[0].startswith(f"file {f}: {key} = ")
    assert "would be refused without the env's value" in warned[0]
    caplog.clear()
    f.write_text(f"{key} = {Config().__getattribute__(key)!r}\n")  # a good value hidden
    with caplog.at_level("WARNING", logger="kvd.config"):
        load(str(f), env)
    assert not [r for r in caplog.records if r.name == "kvd.config"]


def test_values_fine_together_in_their_file_are_not_warned_of_when_hidden(tmp_path, caplog):
    """Each hidden value checked alone against the effective configuration warned of
    combinations no source makes: the file's pair is fine on its own."""
    f = tmp_path / "kvd.toml"
    f.write_text('extent_size = "4M"\nmin_slot_bytes = "1M"\n')
    load(str(f), {})
    env = {"KVD_EXTENT_SIZE": "512K", "KVD_MIN_SLOT_BYTES": "64K"}
    with caplog.at_level("WARNING", logger="kvd.config"):
        cfg, _ = load(str(f), env)
    assert cfg.extent_size == 512 << 10
    assert not [r for r in caplog.records if r.name == "kvd.config"]


def test_a_hidden_value_is_warned_of_only_where_it_is_the_cause(tmp_path, caplog):
    """Checked as a whole source read without those above it, a file with a hidden
    problem beside a flag went unwarned, and a file refused for a value nobody hides
    was warned of because some other value of it was hidden."""
    f = tmp_path / "kvd.toml"
    f.write_text('min_slot_bytes = "1M"\n')
    with caplog.at_level("WARNING", logger="kvd.config"):  # the flag makes it a problem
        load(str(f), {"KVD_MIN_SLOT_BYTES": "64K"}, {"extent_size": "512K"})
    warned = [r.getMessage() for r in caplog.records if r.name == "kvd.config"]
    assert len(warned) == 1 and "min_slot_bytes = 1048576" in warned[0]
    caplog.clear()
    f.write_text(f'disk_path = "{tmp_path}/disk"\npool_size = "8G"\n')
    with caplog.at_level("WARNING", logger="kvd.config"):  # pool_size is not the cause
        load(str(f), {"KVD_DISK_SIZE": "100G", "KVD_POOL_SIZE": "16G"})
    assert not [r for r in caplog.records if r.name == "kvd.config"]


def test_a_bad_value_hidden_by_a_variable_and_a_flag_both_is_warned_of(tmp_path, caplog):
    """Left out one at a time, each hiding source still had the other hiding the file's
    value, so nothing was said; the file stops the daemon once both go."""
    f = tmp_path / "kvd.toml"
    f.write_text("max_lease_ms = 0\n")
    with caplog.at_level("WARNING", logger="kvd.config"):
        cfg, origin = load(str(f), {"KVD_MAX_LEASE_MS": "100"}, {"max_lease_ms": 200})
    assert cfg.max_lease_ms == 200 and origin["max_lease_ms"] == "flag"
    warned = [r.getMessage() for r in caplog.records if r.name == "kvd.config"]
    assert len(warned) == 1 and warned[0].startswith(f"file {f}: max_lease_ms = 0 ")
    assert "without the env's and the flag's values" in warned[0]


def test_two_bad_values_hidden_by_two_sources_are_each_warned_of(tmp_path, caplog):
    """Once one hidden value was said, the source's other one, hidden by another
    source, went unsaid (and stopped the daemon the day that source went)."""
    f = tmp_path / "kvd.toml"
    f.write_text("max_lease_ms = 0\nremote_lookup_ms = -5\n")
    with caplog.at_level("WARNING", logger="kvd.config"):
        load(str(f), {"KVD_MAX_LEASE_MS": "100"}, {"remote_lookup_ms": 5})
    warned = sorted(r.getMessage() for r in caplog.records if r.name == "kvd.config")
    assert len(warned) == 2
    assert "max_lease_ms = 0 would be refused without the env's value" in warned[0]
    assert "remote_lookup_ms = -5 would be refused without the flag's value" in warned[1]
