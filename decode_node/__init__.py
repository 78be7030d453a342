"""``pdserve decode``: loads prompts' KV from the KV store and streams the generated tokens."""
