"""The engine process side: the engine loop, its core process, model runner, sampler, KV cache."""
