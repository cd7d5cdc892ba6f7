"""gRPC rows: raw tensors over gRPC (the GRPCInferenceService's ModelInfer, grpcio's own stub)
against /v2 binary tensors and /v1 JSON, end to end through gunicorn as `make serve` runs it,
each client decoding the answer to arrays. Ratios are of times measured in one run, the
front ends alternated so all see the same load."""
import statistics

import grpc
import numpy as np
import requests
from blockgrad_client.infer import binary_infer_request
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pb_grpc

from . import workloads
from .measure import Result, at_least, clients_rate, ms, paired
from .rows import binary_infer, json_answer

V1_OUTPUTS = {"blocks": "block_gradients", "accumulated": "accumulated", "losses": "losses"}
ROUNDS = 5  # alternated rounds per front end at the seed size, each on fresh connections
# grpcio's channels to one target share one connection (its global subchannel pool) unless each
# keeps its own: without this, the four "clients" were four streams on one worker.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
ROUND_S = 3.0


def grpc_request(matrix: np.ndarray, factor: int, outputs) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="blockgrad")
    message.inputs.add(name="vectors", datatype="FP32", shape=matrix.shape)
    message.raw_input_contents.append(np.ascontiguousarray(matrix, np.float32).tobytes())
    message.parameters["factor"].int64_param = factor
    for name in outputs:
        message.outputs.add(name=name)
    return message


def grpc_infer(stub, message) -> dict[str, np.ndarray]:
    answer = stub.ModelInfer(message, timeout=300)
    return {out.name: np.frombuffer(raw, "<i8" if out.datatype == "INT64" else "<f4").reshape(out.shape)
            for out, raw in zip(answer.outputs, answer.raw_output_contents)}


def grpc_vs_v2(bench) -> list[Result]:
    server, results = bench.server(), []
    channel = grpc.insecure_channel(server.grpc_target, options=[("grpc.max_receive_message_length", 1 << 30)])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    seed = np.array(workloads.SEED_EXAMPLE, dtype=np.float32)
    seed_v1 = workloads.body(workloads.SEED_EXAMPLE, factor=2)  # blocks and accumulated
    seed_v2 = binary_infer_request(seed, {"factor": 2}, ["block_gradients", "accumulated"])
    seed_grpc = grpc_request(seed, 2, ["block_gradients", "accumulated"])
    channels = []  # each gRPC client its own HTTP/2 connection, as each HTTP client its Session

    def own_stub():
        channels.append(grpc.insecure_channel(server.grpc_target, options=OWN_CONNECTION))
        return pb_grpc.GRPCInferenceServiceStub(channels[-1])

    front_ends = {
        "gRPC": lambda: (lambda s=own_stub(): grpc_infer(s, seed_grpc)),
        "/v2 binary": lambda: (lambda s=requests.Session(): binary_infer(s, server.url, *seed_v2)),
        "/v1 JSON": lambda: (lambda s=requests.Session(): json_answer(s, server.url, seed_v1)),
    }
    for clients in (1, 4):
        rates = {name: [] for name in front_ends}
        latency = {name: [] for name in front_ends}
        for _ in range(ROUNDS):
            for name, make_call in front_ends.items():
                try:
                    rate, median, _ = clients_rate(make_call, clients, ROUND_S)
                finally:
                    while channels:  # a round's connections end with it
                        channels.pop().close()
                rates[name].append(rate)
                latency[name].append(median)
        rate = {name: statistics.median(values) for name, values in rates.items()}
        ratio = rate["gRPC"] / rate["/v2 binary"]
        results.append(Result(f"G1. seed 10x5 (blocks, accumulated), {clients} client{'s' * (clients > 1)}: "
                              "gRPC vs /v2 binary", ">= 1.0x", f"{ratio:.2f}x", at_least(ratio, 1.0),
                              f"{rate['gRPC']:.0f} vs {rate['/v2 binary']:.0f} req/s (/v1 JSON {rate['/v1 JSON']:.0f},"
                              f" gRPC {rate['gRPC'] / rate['/v1 JSON']:.2f}x of it); median latency "
                              + ", ".join(f"{name} {ms(statistics.median(v))}" for name, v in latency.items())))
    for n, dim, factor in ((128, 64, 4), (256, 64, 8)):
        matrix = workloads.vectors(n, dim).astype(np.float32)
        v2_body = binary_infer_request(matrix, {"factor": factor})
        message = grpc_request(matrix, factor, ["block_gradients", "accumulated", "bounds", "losses"])
        v1_body = workloads.body(matrix, factor=factor, outputs=list(V1_OUTPUTS))
        session = requests.Session()
        tensors = grpc_infer(stub, message)  # warm-up, and proof of the same numbers
        _, binary = binary_infer(session, server.url, *v2_body)
        if not np.array_equal(tensors["block_gradients"], binary["block_gradients"]):
            raise RuntimeError("gRPC and /v2 disagree on block_gradients")
        vs_v2 = paired(lambda: binary_infer(session, server.url, *v2_body), lambda: grpc_infer(stub, message), 9)
        vs_v1 = paired(lambda: json_answer(session, server.url, v1_body), lambda: grpc_infer(stub, message), 5)
        results.append(Result(f"G2. N={n} D={dim} F={factor}, all outputs (block gradients): gRPC vs /v2 binary",
                              ">= 1.0x", f"{vs_v2.ratio:.2f}x", at_least(vs_v2.ratio, 1.0),
                              f"/v2 binary {ms(vs_v2.a_s)}, gRPC {ms(vs_v2.b_s)}; /v1 JSON {ms(vs_v1.a_s)}: "
                              f"gRPC {vs_v1.ratio:.1f}x faster"))
        floor = echo_floor(stub.ModelInfer(message, timeout=300).ByteSize())
        vs_floor = paired(lambda: binary_infer(session, server.url, *v2_body), floor, 9)
        results.append(Result(f"G3. N={n} D={dim} F={factor}: /v2 binary's whole request vs grpcio alone carrying "
                              "an answer of the same size (no computing)", "-", f"{vs_floor.ratio:.2f}x", "-",
                              f"/v2 binary {ms(vs_floor.a_s)}, grpcio's transport alone {ms(vs_floor.b_s)}; a "
                              "unary answer leaves only once computed and encoded whole, /v2 streams its blocks "
                              "as they are computed"))
    channel.close()
    return results


def echo_floor(nbytes: int):
    """A call to an in-process grpcio server whose handler returns `nbytes` ready-made bytes:
    what grpcio's transport of such an answer costs, with nothing computed or encoded."""
    from concurrent.futures import ThreadPoolExecutor

    payload = bytes(nbytes)
    server = grpc.server(ThreadPoolExecutor(2), options=[("grpc.max_send_message_length", 1 << 30)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "echo", {"Answer": grpc.unary_unary_rpc_method_handler(lambda request, context: payload)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 1 << 30)])
    answer = channel.unary_unary("/echo/Answer")
    return lambda kept=server: answer(b"", timeout=300)  # the server lives as long as the call
