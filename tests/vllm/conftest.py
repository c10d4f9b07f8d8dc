import pytest

from helpers.small_model import build_small_model


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """A Qwen2 model folder vLLM's CPU attention accepts (head_dim 64), random weights from seed 0."""
    return build_small_model(tmp_path_factory.mktemp("small_model"), seed=0)
