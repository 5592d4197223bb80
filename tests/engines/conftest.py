"""The fake CUDA driver as a fixture: shut down after each test, which must leave no
violation of CUDA's rules (tests/engines/fake_cuda.py)."""

from __future__ import annotations

import pytest

from tests.engines.fake_cuda import FakeCuda


@pytest.fixture
def fake():
    f = FakeCuda()
    yield f
    f.shutdown()
    assert f.violations == []
