"""The fallback prefault (kernels without MADV_POPULATE_WRITE) keeps the pool's bytes."""

from __future__ import annotations

import mmap

import numpy as np

from kvd.pool import Pool, touch_pages


def test_touching_pages_keeps_every_byte(tmp_path):
    path = tmp_path / "pool"
    size = 8 * mmap.PAGESIZE
    data = (np.arange(size) % 251 + 1).astype(np.uint8)  # no zero byte at a page start
    path.write_bytes(data.tobytes())
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), size)
        array = np.frombuffer(mm, np.uint8)
        touch_pages(array)
        assert np.array_equal(array, data)
        del array
        mm.close()


def test_a_kept_pool_survives_its_prefault(tmp_path):
    path = str(tmp_path / "pool")
    size = 4 * mmap.PAGESIZE
    pool = Pool(path, size, keep=True)
    pool.array[:] = 7
    pool.close()
    again = Pool(path, size, keep=True)
    assert again.reused and (again.array == 7).all()
    again.close(unlink=True)
