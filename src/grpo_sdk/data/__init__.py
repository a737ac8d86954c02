"""Data loading: where prompts come from and how they become what the model sees.

``prompts`` reads, checks, templates and tokenizes a dataset's rows (local files through
``files``, datasets by name through ``hub``); ``prompt_sources`` draws them for the steps (a
dataset, a weighted mixture, or an environment that makes its own), with exact resume.
"""
