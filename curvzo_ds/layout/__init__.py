"""Where the weights live: the layout decision (choice.py: stage 0 or ZeRO-3, the shard groups, the directions rule)
and the memory model that plans it and `curvzo-ds plan` prints (memory.py, plan.py, prefetch.py, shapes.py)."""
