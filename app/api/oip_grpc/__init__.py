"""The Open Inference Protocol over gRPC: Triton's `inference.GRPCInferenceService`
(grpc_service.proto, through the stubs tritonclient[grpc] generates) and grpc.health.v1.

codec.py describes a ModelInferRequest to the pipeline as /v2's document and renders the
result as raw output tensors; service.py is the servicer, its one table from error codes to
gRPC statuses and the token check. app/serving/grpc_server.py runs it in each worker.
"""
