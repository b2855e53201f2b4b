"""An OpenAI-compatible HTTP server on the `Generator` (`pip install 'sparseserve_hf[serve]'`).

    sparseserve-hf serve [MODEL_FOLDER] --port 8000      # or: python -m sparseserve_hf.serve

`protocol` turns OpenAI request bodies into prompts and `SamplingParams` (and refuses what it
cannot honour), `engine` runs the Generator on its own thread behind thread-safe queues,
`metrics` holds the Prometheus series, `app` is the FastAPI application and `cli` the command.
Importing `sparseserve_hf` never imports this package (FastAPI is an optional dependency).
"""
