import pytest

from p2prl.policy import load_policy


@pytest.fixture(scope="session")
def builtin_policy():
    """The shipped base policy; tests that train must load their own copy."""
    return load_policy("builtin")
