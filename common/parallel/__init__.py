"""Tensor parallelism: the rank's process groups (``group.py``), the sharded layers
(``layers.py``) and the executor that runs one scheduler over N ranks (``executor.py``).

With ``tensor_parallel_size=1`` none of it is imported on the step path: the engine runs the
single-device model exactly as before (no extra processes, no extra ops).
"""
