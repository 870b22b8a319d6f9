"""What runs with a parallel model: its state, the ordered forward wrappers, CFG exchange, step caching, compile, stages, memory and progress."""
