"""The request walk: which modules of app/ one seed-size request enters, in order.

    python -m bench.request_walk            # /v1, /v2 and /v1/jobs (the job's POST, to a stub store)

After three warm-ups, one request through Flask's test client is traced with sys.setprofile and
threading.setprofile; every Python call whose file is under app/ counts. `modules` is how many
files of app/ it entered, `switches` how often a call into app/ is in another file than the call
before it, `walk` the files in the order first entered. Calls outside app/ (Flask, torch) are not counted.
The /v1/jobs POST is walked to the job store's submit on `StubStore` (no cluster here: the real
store would answer 503 cluster_unavailable); the stub itself is outside app/ and not counted.
"""
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app") + "/"

SEED = [[i / 10 + j / 100 for j in range(5)] for i in range(10)]  # the README's 10 x 5 example
REQUESTS = {
    "/v1": ("/v1/gradients", {"vectors": SEED, "outputs": ["accumulated", "losses"]}),
    "/v2": ("/v2/models/blockgrad/infer",
            {"inputs": [{"name": "vectors", "datatype": "FP32", "shape": [10, 5],
                         "data": [x for row in SEED for x in row]}],
             "outputs": [{"name": "accumulated"}, {"name": "losses"}]}),
    "/v1/jobs": ("/v1/jobs", {"vectors": SEED, "outputs": ["accumulated", "losses"]}),
}


def walk(client, path: str, body: dict) -> tuple[int, int, list[str], int]:
    entered: list[str] = []
    calls: list[str] = []

    def profile(frame, event, _arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(APP):
            calls.append(name[len(APP):])
            if calls[-1] not in entered:
                entered.append(calls[-1])

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        status = client.post(path, json=body).status_code
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    switches = sum(1 for before, after in zip(calls, calls[1:]) if before != after)
    return len(entered), switches, entered, status


class StubStore:
    """The job store's submit, answered at once with a queued record (nothing else is walked)."""

    def __init__(self, settings):
        self.settings = settings  # the job limits the pipeline's admit step reads

    def submit(self, req, idempotency_key=None) -> tuple[dict, bool]:
        return {"id": "0" * 32, "status": "queued", "n": req.n, "dim": req.dim, "factor": req.factor}, True


def main() -> None:
    from dataclasses import replace

    from app import create_app
    from app.extensions import install_services, services_of

    app = create_app({"TESTING": True})
    install_services(app, replace(services_of(app), jobs=StubStore(services_of(app).jobs.settings)))
    client = app.test_client()
    for name, (path, body) in REQUESTS.items():
        for _ in range(3):
            client.post(path, json=body)
        modules, switches, order, status = walk(client, path, body)
        print(f"{name}: status {status}, {modules} modules of app/, {switches} module switches")
        print("  " + " -> ".join(order))


if __name__ == "__main__":
    main()
