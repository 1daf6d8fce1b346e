"""kestrel's built-in backends, one package each: cpu_ref (the mmap reference) and cuda (the device weight cache)."""
