"""Memory for request bodies as they arrive (app/core/admission.py, app/http/body.py): never
for what a Content-Length declares; bodies still arriving share at most
BLOCKGRAD_UPLOAD_MEMORY_SHARE of the budget, and a body that has arrived is never held back
by them. In process (Flask's test client); tests/test_hostile_clients.py has real sockets."""
import io

import orjson
import pytest

from app import create_app
from app.core.errors import BlockgradError
from app.core.admission import MemoryLedger, body_parse_bytes, upload_bytes
from app.http import body as http_memory
from app.extensions import services_of
from app.http.body import BODY_PIECE_BYTES

GOOD = {"vectors": [[float(i + j) for j in range(5)] for i in range(10)], "factor": 5}
# Over three pieces of JSON (about 200 KiB): more than one piece, so an upload while it arrives.
LARGE = {"vectors": [[float(i * 40 + j) / 7 for j in range(40)] for i in range(300)], "factor": 3,
         "outputs": ["accumulated"]}


def test_uploads_share_is_a_ceiling_for_uploads_only():
    ledger = MemoryLedger(100, upload_share=0.5)
    upload = ledger.reserve(30, uploading=True)
    with pytest.raises(BlockgradError) as refused:
        ledger.reserve(21, uploading=True)  # 30 + 21 over the uploads' 50
    assert refused.value.code == "overloaded"
    assert refused.value.details == {"limit": "BLOCKGRAD_UPLOAD_MEMORY_SHARE", "value": 21, "reserved": 30,
                                     "allowed": 50}
    arrived = ledger.reserve(70)  # a body that has arrived: the whole budget is open to it
    assert (ledger.reserved, ledger.uploading) == (100, 30)
    arrived.release()
    with pytest.raises(BlockgradError):
        upload.resize(51)  # one upload alone over the share can never fit: limit_exceeded
    upload.resize(50)
    assert ledger.uploading == 50
    upload.settle()  # its body has arrived: out of the uploads' share, still in the budget
    assert (ledger.reserved, ledger.uploading) == (50, 0)
    second = ledger.reserve(50, uploading=True)
    upload.resize(50)
    second.release()
    upload.release()
    upload.release()
    assert (ledger.reserved, ledger.uploading) == (0, 0)


def test_a_released_upload_leaves_the_share():
    ledger = MemoryLedger(100, upload_share=0.5)
    ledger.reserve(50, uploading=True).release()
    ledger.reserve(50, uploading=True)
    assert ledger.uploading == 50


def test_a_share_above_one_counts_as_one():
    assert MemoryLedger(100, upload_share=3.0).upload_budget == 100


def test_the_reservation_grows_with_the_body_from_nothing(monkeypatch):
    app = create_app({"TESTING": True})
    ledger = services_of(app).ledger
    seen = []
    original = http_memory.reserve_for_request

    def spy(held_in, nbytes, upload=False):
        if upload:
            seen.append((nbytes, ledger.reserved))
        original(held_in, nbytes, upload)
    monkeypatch.setattr("app.http.body.reserve_for_request", spy)
    body = orjson.dumps(LARGE)
    assert len(body) > 3 * BODY_PIECE_BYTES
    response = app.test_client().post("/v1/gradients", data=body, content_type="application/json")
    assert response.status_code == 200, response.get_data()[:300]
    pieces = len(body) // BODY_PIECE_BYTES  # every whole piece with more to come
    assert [nbytes for nbytes, _ in seen] == [upload_bytes(k * BODY_PIECE_BYTES) for k in range(1, pieces + 1)]
    assert seen[0][1] == 0  # nothing was reserved before the first piece had arrived
    assert max(nbytes for nbytes, _ in seen) < body_parse_bytes(len(body), binary=False)
    assert (ledger.reserved, ledger.uploading) == (0, 0)


def test_a_small_body_is_never_an_upload(monkeypatch):
    app = create_app({"TESTING": True})
    original = http_memory.reserve_for_request

    def refuse_uploads(held_in, nbytes, upload=False):
        assert not upload, "held as an upload"
        original(held_in, nbytes)
    monkeypatch.setattr("app.http.body.reserve_for_request", refuse_uploads)
    assert app.test_client().post("/v1/gradients", json=GOOD).status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_uploads_filling_their_share_hold_back_uploads_not_small_requests(chunked):
    app = create_app({"TESTING": True})
    ledger = services_of(app).ledger
    others = ledger.reserve(ledger.upload_budget, uploading=True)  # slow uploads hold the whole share
    client = app.test_client()

    def post(document):
        body = orjson.dumps(document)
        if chunked:  # no Content-Length: a stream the server ends, as gunicorn's chunked reader
            return client.post("/v1/gradients", input_stream=io.BytesIO(body), content_type="application/json",
                               environ_overrides={"wsgi.input_terminated": True, "HTTP_TRANSFER_ENCODING": "chunked"})
        return client.post("/v1/gradients", data=body, content_type="application/json")
    assert post(GOOD).status_code == 200
    refused = post(LARGE)
    assert refused.status_code == 503
    assert refused.get_json()["error"]["details"]["limit"] == "BLOCKGRAD_UPLOAD_MEMORY_SHARE"
    assert "Retry-After" in refused.headers
    assert ledger.reserved == others.nbytes  # the refused one gave back what it held
    others.release()
    assert post(LARGE).status_code == 200
    assert (ledger.reserved, ledger.uploading) == (0, 0)


def test_a_declared_body_whose_parse_cannot_fit_is_refused_before_reading(monkeypatch):
    app = create_app({"TESTING": True, "BLOCKGRAD_WORKER_MEMORY_BYTES": str(40 * 2 ** 20)})
    monkeypatch.setattr("app.http.body.read_arriving", lambda request, ledger: pytest.fail("read"))
    response = app.test_client().post("/v1/gradients", data=b" " * 2_000_000, content_type="application/json")
    assert response.status_code == 413
    assert response.get_json()["error"]["details"]["limit"] == "BLOCKGRAD_WORKER_MEMORY_BYTES"
