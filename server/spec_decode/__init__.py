"""Speculative decoding: proposers (n-gram prompt lookup), verification by exact acceptance.

`config`, `ngram` and `stats` are plain Python (the scheduler may import them); `rejection_sampler`
uses torch and is called by the worker only.
"""
