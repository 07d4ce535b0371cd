"""Hypothesis profiles, and a fixture the block refit tests share.

``ci`` (the default): derandomized, so the suite draws the same examples on every run and a CI
result can be reproduced. ``explore``: fresh random examples on every run, to look for new failures:
``HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest``.
"""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The suite runs on every core (pytest-xdist, ``-n auto --dist loadfile`` in pyproject.toml: a file's tests
# run on one worker, so a module-scoped fixture is computed once; xdist's ``loadgroup`` does not group
# under pytest 9.2, measured). Each worker keeps BLAS to one thread, so two workers on CI's two cores do
# not fight over them (subprocesses inherit it).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 8 (each worker may load torch and transformers)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 8))


# The files that take longest (measured: `pytest --durations`), first: xdist hands whole files to workers
# in collection order, and a long file started last would leave one worker running it alone.
# Re-measured (per-file totals from `pytest --junitxml`, 2-core machine): the block files first, 120 s down to 45 s.
_LONGEST_FIRST = ("test_block_ln_eps.py", "test_block_extract.py", "test_block_resume.py", "test_encoder_method.py",
                  "test_block_activations.py", "test_block_float32.py", "test_reproduce.py", "test_block_method.py",
                  "test_rope_method.py", "test_server_fuzz.py", "test_server_cli.py", "test_server_client.py",
                  "test_block_torch.py", "test_sentences.py", "test_multihead_real.py", "test_server_crash.py",
                  "test_pipeline_http.py", "test_block_image.py", "test_encoder_precision.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: order within a file kept


@pytest.fixture
def perturbed_block():
    """A refit problem: a random block (d = 8, beta_1, b_K, b_V != 0), 60 sequences of 4 tokens and its
    answers, and a start with W_1 moved by 1e-2: ``(truth, start, X, Y)``."""
    import dataclasses

    import numpy as np

    from headthief.models.bert_block import random_block
    truth = random_block(8, 2, 8, seed=3)
    rng = np.random.default_rng(5)
    X = rng.standard_normal((60, 4, 8))
    start = dataclasses.replace(truth, W1=truth.W1 + 1e-2 * rng.standard_normal(truth.W1.shape))
    return truth, start, X, truth.forward(X)

