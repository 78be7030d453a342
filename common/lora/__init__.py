"""LoRA adapters served beside the base model (PEFT format), many per step.

``adapter``: what names an adapter and what its directory must hold (no torch: node frontends
validate with it); ``weights``: its tensors, read into the fused projections' layout;
``manager``: the device slots, loaded on demand, least recently used out; ``batch``: one step's
rows per adapter and the deltas applied to each projection (Triton on CUDA, grouped GEMMs on
the CPU).
"""
