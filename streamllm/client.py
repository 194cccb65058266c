"""The thin client (no torch): `from streamllm.client import Client`. It lives in streamllm.service.client."""

from streamllm.service.client import AsyncClient, Client, ServiceError

__all__ = ["AsyncClient", "Client", "ServiceError"]
