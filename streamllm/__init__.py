"""streamllm: streaming market-data analytics on stateful transformer sessions."""
