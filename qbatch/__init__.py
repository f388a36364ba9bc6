"""qbatch: offline batch inference for small LLMs on vLLM."""

__version__ = "0.1.0"
