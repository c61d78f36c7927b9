"""tests/gpu: the CUDA suite, marker `gpu` (`python -m pytest -m gpu`), skipped where torch sees no GPU."""

import pytest

from tests.gpu.devices import SKIP_REASON, cuda_missing


def pytest_collection_modifyitems(config, items):
    if not cuda_missing():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
