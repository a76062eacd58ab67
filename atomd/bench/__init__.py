"""`atomd bench`: a serving benchmark that speaks the OpenAI API, modelled on `vllm bench serve`.

datasets  -> the prompts (random, shared-prefix, ShareGPT file) with their expected lengths
client    -> arrival schedule (Poisson / gamma), the streaming request function, the load loop
metrics   -> RequestResult timelines -> vLLM's metric names and definitions
report    -> the printed table, the result JSON, the PNG plots, `bench compare`
cli       -> the `serve` and `compare` subcommands
"""
