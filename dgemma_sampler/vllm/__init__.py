"""vLLM integration: the plugin entry point and FusedDiffusionSampler."""
