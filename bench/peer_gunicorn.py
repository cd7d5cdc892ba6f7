"""gunicorn settings for the reference peer (bench/peer.py): sync workers, nothing else (an
info row of bench/small_requests.py switches it to gthread through GUNICORN_CMD_ARGS).

The launcher (bench/small_requests.py) gives the bind on the command line and the worker and
torch-thread counts in the environment, so that the peer runs as many of each as the service.
"""
import os

workers = int(os.environ.get("PEER_WORKERS", "2"))
worker_class = "sync"
accesslog = None
errorlog = "-"


def post_worker_init(worker):
    import torch

    torch.set_num_threads(int(os.environ.get("PEER_TORCH_THREADS", "1")))
