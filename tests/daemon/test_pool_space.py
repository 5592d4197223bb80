"""A pool larger than its filesystem's free room (a container's 64 MiB /dev/shm) is a
clear error at start, not a daemon killed by SIGBUS at its first copy."""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys

import pytest

from kvd.errors import ConfigError
from kvd.pool import Pool
from tests.waiting import in_child


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MiB tmpfs of its own (needs the right to mount, as root in a container has)."""
    where = tmp_path / "shm"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_pool_too_large_for_its_filesystem_is_refused(small_tmpfs):
    path = str(small_tmpfs / "kvd.pool")
    with pytest.raises(ConfigError, match="No space left.*MiB free there"):
        Pool(path, 64 << 20)
    assert os.listdir(small_tmpfs) == []  # nothing left taking the room
    pool = Pool(path, 8 << 20)  # what fits is served
    pool.array[:] = 1
    assert int(pool.array.sum()) == 8 << 20
    pool.close()


def test_a_kept_pool_that_cannot_be_reserved_again_is_kept(small_tmpfs):
    """A warm-restart pool with a hole the filesystem has no room to fill any more: the
    start fails, and the file with its cached bytes stays for a start with more room."""
    path = small_tmpfs / "kvd.pool"
    pool = Pool(str(path), 8 << 20, keep=True)
    pool.array[:] = 3
    pool.close()
    (small_tmpfs / "filler").write_bytes(b"x" * (8 << 20))
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "r+b") as f:  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        assert libc.fallocate(f.fileno(), 3, ctypes.c_long(0), ctypes.c_long(1 << 20)) == 0
    (small_tmpfs / "filler2").write_bytes(b"x" * (1 << 20))
    with pytest.raises(ConfigError, match="No space left"):
        Pool(str(path), 8 << 20, keep=True)
    assert path.stat().st_size == 8 << 20
    assert set(path.read_bytes()[1 << 20:]) == {3}


def test_the_daemon_stops_with_a_clear_error(small_tmpfs, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    r = subprocess.run([sys.executable, "-m", "kvd.cli.serve", "serve",
                        "--socket", str(tmp_path / "kvd.sock"),
                        "--pool-path", str(small_tmpfs / "kvd.pool"), "--pool-size", "64M",
                        "--extent-size", "1M", "--metrics-port", "0"],
                       capture_output=True, text=True, timeout=60, env=env, check=False)
    assert r.returncode not in (0, -7), r  # -7: SIGBUS
    assert "cannot reserve 64 MiB" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(small_tmpfs) == []


def test_a_pool_its_address_space_cannot_map_says_so(small_tmpfs):
    """The file reserved, its mapping refused (ENOMEM under an address-space limit): the
    error sent operators to /dev/shm's size, which was not the cause."""
    path = str(small_tmpfs / "kvd.pool")

    def refused() -> bool:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        limit = (vm << 10) + (2 << 20)  # 2 MiB more than this process maps: not 8
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            Pool(path, 8 << 20)
        except ConfigError as e:
            return "cannot map pool file" in str(e) and "LimitAS" in str(e) \
                and "/dev/shm" not in str(e)
        return False

    assert in_child(refused, 30) == 0
    assert os.listdir(small_tmpfs) == []  # the file this start made is gone


def test_a_pool_size_of_no_whole_extents_reserves_only_whole_ones(daemon_factory):
    """pool_size 3M with 2M extents reserved (and faulted in) 3 MiB of /dev/shm, of which
    the allocator could use 2; the rest was pinned for nothing."""
    d = daemon_factory("--pool-size", "3M", "--extent-size", "2M")
    assert os.path.getsize(d.pool_path) == 2 << 20
    assert d.status()["pool"]["capacity_bytes"] == 2 << 20
    assert "pool_size 3145728 is not a multiple of extent_size 2097152" in d.logs()


def _on_tmpfs(path) -> bool:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                          text=True, check=False).stdout.strip() == "tmpfs"


def test_a_pool_path_that_is_no_pool_of_kvd_is_refused_untouched(tmp_path):
    """A start that could not size what pool_path named removed it: /dev/null was deleted
    by one; and a file on disk there (a config file, say) was emptied at start."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file: kvd leaves it alone"):
        Pool(str(fifo), 8 << 20)
    assert fifo.is_fifo()
    if _on_tmpfs(tmp_path):
        pytest.skip("the temporary directory is a tmpfs: no disk file to check with")
    precious = tmp_path / "kvd.toml"
    precious.write_text("pool_size = \"8M\"\n")
    with pytest.raises(ConfigError, match="will not empty it"):
        Pool(str(precious), 8 << 20)
    assert precious.read_text() == "pool_size = \"8M\"\n"
    image = tmp_path / "disk.img"  # of exactly the pool's size, as images often are
    image.write_bytes(b"\7" * (4 << 20))
    with pytest.raises(ConfigError, match="no pool kvd made"):
        Pool(str(image), 4 << 20)
    assert image.read_bytes() == b"\7" * (4 << 20)


def test_pools_kvd_left_on_a_disk_filesystem_are_taken_again(tmp_path):
    """A pool a kill -9 left (kvd marks the files it makes), and one a warm restart
    (persistence) names, are kvd's own wherever they are: refusing them kept a crashed
    kvd from restarting."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.kvd.probe", b"1")
    except OSError as e:
        pytest.skip(f"no user xattrs here: {e.strerror}")
    path = tmp_path / "kvd.pool"
    Pool(str(path), 4 << 20, prefault=False).close(unlink=False)  # as a kill -9 leaves it
    Pool(str(path), 4 << 20, prefault=False).close()
    Pool(str(path), 4 << 20, prefault=False, keep=True).close(unlink=False)
    pool = Pool(str(path), 8 << 20, prefault=False, keep=True)  # persistence, resized
    assert not pool.reused
    pool.close()


def test_a_pool_path_linking_to_a_file_gone_makes_it_there(tmp_path):
    """A link to a hugetlbfs file a reboot removed: the start failed ("No such file")."""
    target, link = tmp_path / "target.pool", tmp_path / "kvd.pool"
    link.symlink_to(target)
    pool = Pool(str(link), 4 << 20, prefault=False)
    assert target.stat().st_size == 4 << 20
    pool.close()  # the file goes, the link stays (a tmpfiles.d line owns it)
    assert link.is_symlink() and not target.exists()
    with pytest.raises(ConfigError, match="cannot size pool file"):
        Pool(str(link), 1 << 62, prefault=False)  # a failed start removes what it made
    assert link.is_symlink() and not target.exists()


def test_a_pool_file_of_another_user_is_refused_untouched(small_tmpfs):
    path = small_tmpfs / "kvd.pool"
    path.write_bytes(b"theirs")
    os.chown(path, 65534, 65534)  # (small_tmpfs needs root already)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        Pool(str(path), 8 << 20)
    assert path.read_bytes() == b"theirs"


def test_a_stale_pool_of_this_user_in_a_tmpfs_is_taken_and_a_failed_start_keeps_it(
        small_tmpfs):
    """A pool a killed kvd left (no persistence) is emptied and used, as before; a start
    that fails on it leaves the file (emptied), where it removed it before."""
    path = small_tmpfs / "kvd.pool"
    path.write_bytes(b"\1" * (1 << 20))
    pool = Pool(str(path), 4 << 20)
    assert int(pool.array.sum()) == 0  # stale bytes never survive
    pool.close()  # and a pool it took is removed at its stop, as one it made
    assert not path.exists()
    path.write_bytes(b"\1" * (1 << 20))
    with pytest.raises(ConfigError, match="No space left"):
        Pool(str(path), 64 << 20)
    assert path.exists()


def test_the_stop_removes_the_pool_file_only(small_tmpfs):
    """The stop removed whatever the path led to then: a file another kvd made there
    after a clean-up removed this one's (its warm restart found nothing)."""
    path = small_tmpfs / "kvd.pool"
    pool = Pool(str(path), 4 << 20, prefault=False)
    path.unlink()
    path.write_bytes(b"another kvd's")
    pool.close()
    assert path.read_bytes() == b"another kvd's"
