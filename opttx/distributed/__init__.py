"""Distributed opttx: sharding specs, the explicit collective transform, data parallelism.

Every layer-wise reduction in opttx calls `opttx.base.reduce_statistics(partials, extra_args,
op, dims)`, the identity on one device. `sharded(tx, specs)` passes a reducer under
``extra_args[opttx.base.REDUCER_KEY]`` that turns those calls into batched functional
all-reduces over exactly the groups that shard each leaf's reduced dims, so any chain run on
local shards gives the single-device result. `all_reduce_gradients(group)` averages gradients
in flat buckets as the first link of a chain.

Example:
  >>> from opttx.distributed import Replicated, Shard, sharded
  >>> tx = sharded(opttx.lamb(1e-3), {"w": Shard(0, tp_group), "b": Replicated()})
"""

from .checkpoint import (check_checkpoint, load_checkpoint, load_state_dict, param_paths,
                         read_metadata, save_checkpoint, state_dict, verify_checkpoint)
from .consistency import consistency_checks, set_consistency_checks
from .data_parallel import all_reduce_gradients, plan_buckets
from .diloco import DiLoCoState, diloco, diloco_fragments, diloco_schedule
from .eval_params import schedule_free_eval_params
from .eval_params import ema_eval_params
from .launch import init_process_group_for_restarts
from .overlap import BackwardLaunches, no_sync
from .owners import OwnerPlan, default_cost, on_owners, plan_owners
from .reducer import CollectiveStats, ShardedReducer, pack_all_reduce
from .shapes import global_factor_axes, global_shapes, raise_on_every_rank
from .sharded import sharded
from .specs import (LeafSpec, Replicated, Shard, flatten_specs, local_shard, shard_groups,
                    specs_from_dtensors)
from .zero import ZeroChunk, ZeroPlan, state_costs, zero, zero_plan
from .offload import (OffloadChunk, OffloadMasterState, OffloadPlan, OffloadStats,
                      check_offloadable, offload, offload_plan, place_chunks)
from .counting import CollectiveCounts, count_collectives

__all__ = [
    "BackwardLaunches",
    "CollectiveStats",
    "LeafSpec",
    "OffloadChunk",
    "OffloadMasterState",
    "OffloadPlan",
    "OffloadStats",
    "OwnerPlan",
    "Replicated",
    "Shard",
    "ShardedReducer",
    "ZeroChunk",
    "ZeroPlan",
    "all_reduce_gradients",
    "check_checkpoint",
    "check_offloadable",
    "consistency_checks",
    "default_cost",
    "flatten_specs",
    "global_factor_axes",
    "global_shapes",
    "init_process_group_for_restarts",
    "load_checkpoint",
    "load_state_dict",
    "local_shard",
    "no_sync",
    "offload",
    "offload_plan",
    "on_owners",
    "pack_all_reduce",
    "param_paths",
    "place_chunks",
    "plan_buckets",
    "plan_owners",
    "raise_on_every_rank",
    "read_metadata",
    "shard_groups",
    "save_checkpoint",
    "schedule_free_eval_params",
    "ema_eval_params",
    "set_consistency_checks",
    "sharded",
    "specs_from_dtensors",
    "state_costs",
    "state_dict",
    "verify_checkpoint",
    "zero",
    "zero_plan",
    "DiLoCoState",
    "diloco",
    "diloco_fragments",
    "diloco_schedule",
    "CollectiveCounts",
    "count_collectives",
]
