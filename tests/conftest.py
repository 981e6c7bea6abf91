import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pallaskit  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state():
    pallaskit.metrics.reset()
    pallaskit.config.reset()
    yield
    pallaskit.config.reset()


@pytest.fixture
def rng(request):
    """A numpy Generator seeded by the test's id: fresh data per test, reproducible."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def tolerance(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.dtype(jax.numpy.bfloat16):
        return dict(rtol=2e-2, atol=2e-2)
    if dtype == np.float16:
        return dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=1e-5, atol=1e-5)


def assert_close(actual, expected, dtype=None):
    dtype = dtype or np.asarray(expected).dtype
    a = np.asarray(actual, dtype=np.float64) if np.asarray(actual).dtype != bool else np.asarray(actual)
    e = np.asarray(expected, dtype=np.float64) if np.asarray(expected).dtype != bool else np.asarray(expected)
    assert a.shape == e.shape, (a.shape, e.shape)
    if a.dtype == bool or np.issubdtype(np.dtype(dtype), np.integer):
        np.testing.assert_array_equal(a, e)
    else:
        np.testing.assert_allclose(a, e, **tolerance(dtype))
