"""The Open Inference Protocol (KServe "V2", as served by Triton) over REST, for one model.

model.py names the model and its tensors, schemas.py is the shape of the JSON
documents, codec.py the binary tensor data extension (bytes <-> arrays),
infer.py turns a request into the shared GradientRequest and runs it, views.py
the routes. Validation and limits are the /v1 ones, called, not copied.
"""
