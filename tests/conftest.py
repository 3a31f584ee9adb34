import os
from pathlib import Path

# opttx's distributed checking mode in every test and every rank they start (the environment
# reaches spawned processes): each update of sharded and zero compares the ranks' replicated
# parameters and step counters (opttx.distributed.consistency). Read when opttx is imported.
os.environ.setdefault("OPTTX_CONSISTENCY_CHECKS", "1")

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings

# "ci" is derandomized so a CI failure reproduces; "dev" explores new examples each run.
settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def world_of_one(tmp_path: Path):
    """A gloo process group of one rank (this process) for the test: every collective is real
    but trivial. Tests of several ranks spawn processes instead."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
