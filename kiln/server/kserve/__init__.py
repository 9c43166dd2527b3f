"""KServe v2 / Open Inference Protocol (what Triton Inference Server speaks), over HTTP and gRPC,
on the same engine, admission and drain as the OpenAI routes. Two models, `tensorrt_llm` (token
ids) and `ensemble` (text), declared as the TensorRT-LLM backend declares them.

Layout: tensors.py (wire <-> numpy), models.py (the declarations), translate.py (tensors <->
engine requests), core.py (one inference, protocol-neutral), http.py and grpc_service.py (the
two transports). Routes use only ServerState and the shared Generation, never engine internals.
"""

from kiln.server.kserve.grpc_service import grpc_lifespan
from kiln.server.kserve.http import router

__all__ = ["grpc_lifespan", "router"]
