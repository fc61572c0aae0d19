"""Session-wide test set-up: an isolated cache folder, tiny in-memory models, the default engine.

FLASHSPEC_CACHE_DIR holds converted default-model weights and router state. Unless the caller
set it (CI points it at a persistent folder so the ~20 s conversion happens once), tests use a
fresh session folder, so they never read or write a user's real cache.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import helpers` from any test folder

from helpers import one_thread, tiny_llama, tiny_loaded  # noqa: E402

from flashspec_core.models import CACHE_ENV  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def flashspec_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """$FLASHSPEC_CACHE_DIR if set, else a session temporary folder (exported for the session)."""
    if os.environ.get(CACHE_ENV):
        yield Path(os.environ[CACHE_ENV])
        return
    path = tmp_path_factory.mktemp("flashspec-cache")
    os.environ[CACHE_ENV] = str(path)
    try:
        yield path
    finally:
        os.environ.pop(CACHE_ENV, None)


@pytest.fixture
def torch_one_thread():
    """Tiny models are dominated by per-op overhead; one thread avoids contention on busy cores."""
    with one_thread():
        yield


@pytest.fixture(scope="session")
def tiny_target():
    """A tiny random target (vocab 16, eos = token 15) with its in-memory tokenizer."""
    return tiny_loaded(16, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_model():
    """Another tiny random model with the target's vocabulary, so a model draft's q is non-trivial."""
    return tiny_llama(16, seed=1)


@pytest.fixture(scope="session")
def default_target(flashspec_cache_dir):
    """The embedded default model (SmolLM2-135M-Instruct, fp32 CPU), loaded once per session."""
    from flashspec_core.pool import load_target

    return load_target(None)  # the same cached object `from_default` uses


@pytest.fixture(scope="session")
def default_engine(flashspec_cache_dir):
    """`SpecEngine.from_default()`, loaded once per session (it is a per-process singleton)."""
    from flashspec_core.engine import SpecEngine

    return SpecEngine.from_default()
