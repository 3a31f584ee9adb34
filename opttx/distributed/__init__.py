"""Distributed opttx (sharding specs, the explicit collective transform, ZeRO, checkpoints).

Not built yet. The hook it will plug into already exists: every layer-wise reduction in opttx
calls `opttx.base.reduce_statistics(partials, extra_args, op, dims)`, which is the identity
unless ``extra_args[opttx.base.REDUCER_KEY]`` holds a reducer; `sharded(tx, specs)` will pass
one that turns those calls into batched collectives over the groups that shard each leaf.
"""

__all__: list[str] = []
