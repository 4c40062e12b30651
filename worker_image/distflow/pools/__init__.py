"""Asynchronous training on two pools of workers: a rollout pool and a trainer pool.

    elastic       in-place resize of the rollout pool at a step boundary: leaving workers exit, joining
                  ones enter, the others re-form the world in their processes
    weight_sync   versioned, bucketed broadcast of the trainer pool's weights into each rollout replica
    worker        PoolWorker: the DAG worker of a pooled job, its lockstep schedule bounded by
                  async.maxStaleness

The spec section is ``distflow.spec.pools`` (``async``); the planner lays the
pools out (``Layout.first_rank``) and the data coordinator moves samples
across them like over any other edge.
"""
