"""The thin client (no torch): `from streamllm.client import Client`; `watch` is `streamllm watch`'s table."""

from streamllm.client.client import AsyncClient, Client, ServiceError

__all__ = ["AsyncClient", "Client", "ServiceError"]
