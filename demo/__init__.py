"""The kvscope demo: a tiny offline model, a fleet of real vLLM CPU servers, and a labeled workload."""
