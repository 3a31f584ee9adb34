import os

import torch
from hypothesis import HealthCheck, settings

# "ci" is derandomized so a CI failure reproduces; "dev" explores new examples each run.
settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(min(2, torch.get_num_threads()))
