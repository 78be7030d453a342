"""``pdserve prefill``: computes prompts' KV into the KV store and samples their first token."""
