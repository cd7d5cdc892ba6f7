"""The Open Inference Protocol (KServe "V2", as served by Triton) over REST, for one model.

model.py names the model and its tensors, schemas.py is the shape of the JSON
documents, codec.py the binary tensor data extension (bytes <-> arrays), infer.py
describes a request to the pipeline and renders its results as output tensors, views.py
the routes. Validation and limits are the core's, as for /v1. The gRPC front end
(app/api/oip_grpc) shares model.py, infer.py's `describe`, `output_tensors` and
`named_as_protocol`, and codec.py's `slabs`, nothing else.
"""
