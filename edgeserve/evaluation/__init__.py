"""Measuring a model through the engine: sliding-window perplexity and the quality report of a conversion."""
