"""The engine's KV connector over the byte stores of ``kv_store/``: the engine plugin that moves
KV blocks between a paged cache and a store (it imports torch, the kernels and ``common/``; the
stores import none of them).

- ``connector.py``: ``create_store_connector``, both halves over one store URL, and the layout
  fingerprint.
- ``scheduler.py``: the scheduler half (decides what to load and save; touches no tensors).
- ``worker.py``: the worker half, which hands each step to one saver and one loader chosen for
  where the cache lives: ``saver.py`` (CPU copies, a CUDA save stream, the tensor-parallel
  collect), ``loader.py`` (reads straight into a CPU cache) and ``staged_loader.py`` (through
  staging: a CUDA load stream, its CPU twin, the tensor-parallel land).
- ``staging.py``: the ring of reused host buffers (pinned on CUDA) both directions go through.
"""
