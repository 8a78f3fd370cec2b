"""kvscope: how many prompt tokens does the KV cache save, and why did the rest miss?"""

__version__ = "0.1.0"
