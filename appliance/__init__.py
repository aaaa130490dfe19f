"""Prefill/decode disaggregated serving appliance for vLLM with the Mooncake Transfer Engine."""

__version__ = "0.1.0"
